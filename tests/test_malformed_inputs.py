"""Reliability issue, acceptance 7: a table of malformed inputs, each ending in one clear paragraph.

Every case runs the real ``tessera`` command in-process and is refused before anything launches:
exit code 2, stderr one ``tessera: error:`` paragraph (no traceback, no blank line, short even when
the input is huge), naming what is wrong, and nothing written. Cases are grouped by class: config
types and ranges, ``--set`` values, YAML itself, files that are not what they claim, plan files,
cluster files, command-line arguments, output paths.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import yaml
from test_bad_input import GOOD
from test_bad_input import with_change as changed

from tessera.cli import main

BOMB = "\n".join(
    ["a0: &a0 [x, x, x, x, x, x, x, x, x, x]"]
    + [f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 10)}]" for i in range(1, 9)]
)  # ~500 bytes that expand to 10^9 values


# ----------------------------------------------------------------------------------- configs
# (field, bad value, text the error must contain)
WRONG_TYPES = [
    ("model.n_layers", True, "model.n_layers"),
    ("model.dim", False, "model.dim"),
    ("model.dim", 32.0, "model.dim"),
    ("model.dim", "32", "model.dim"),
    ("model.dim", [32], "model.dim"),
    ("model.ffn_dim", {"a": 1}, "model.ffn_dim"),
    ("model.n_heads", None, "model.n_heads"),
    ("model.tie_embeddings", 1, "model.tie_embeddings"),
    ("model.tie_embeddings", "yes please", "model.tie_embeddings"),
    ("model.kind", 7, "model.kind"),
    ("data.seq_len", True, "data.seq_len"),
    ("data.paths", "corpus.txt", "data.paths"),
    ("data.paths", [1, 2], "data.paths"),
    ("data.max_bytes", 1.5, "data.max_bytes"),
    ("optimizer.lr", math.inf, "optimizer.lr"),
    ("optimizer.lr", -math.inf, "optimizer.lr"),
    ("optimizer.lr", math.nan, "optimizer.lr"),
    ("optimizer.lr", True, "optimizer.lr"),
    ("optimizer.lr", "3e-4x", "optimizer.lr"),
    ("optimizer.weight_decay", math.nan, "optimizer.weight_decay"),
    ("optimizer.betas", [0.9], "optimizer.betas"),
    ("optimizer.betas", [0.9, math.inf], "optimizer.betas"),
    ("optimizer.betas", [0.9, 1.5], "optimizer.betas"),
    ("optimizer.betas", "0.9,0.95", "optimizer.betas"),
    ("optimizer.momentum", 1.0, "optimizer.momentum"),
    ("optimizer.grad_clip", math.inf, "optimizer.grad_clip"),
    ("optimizer.grad_clip", 0, "optimizer.grad_clip"),
    ("optimizer.name", "adam", "optimizer.name"),
    ("schedule.warmup_steps", -1, "schedule.warmup_steps"),
    ("schedule.warmup_steps", 2.5, "schedule.warmup_steps"),
    ("schedule.min_lr_ratio", 2.0, "schedule.min_lr_ratio"),
    ("schedule.min_lr_ratio", math.nan, "schedule.min_lr_ratio"),
    ("train.timeout_s", math.inf, "train.timeout_s"),
    ("train.timeout_s", 0, "train.timeout_s"),
    ("train.timeout_s", 1e12, "train.timeout_s"),
    ("train.seed", 2**64, "train.seed"),
    ("train.seed", -1, "train.seed"),
    ("train.seed", 1.5, "train.seed"),
    ("train.steps", True, "train.steps"),
    ("train.steps", 2**60, "train.steps"),
    ("train.global_batch_size", 2**40, "train.global_batch_size"),
    ("train.log_every", 0, "train.log_every"),
    ("train.stop_at", 0, "train.stop_at"),
    ("train.peak_tflops", math.inf, "train.peak_tflops"),
    ("train.peak_tflops", {"cpu": math.nan}, "train.peak_tflops"),
    ("train.peak_tflops", "fast", "train.peak_tflops"),
    ("checkpoint.every", -5, "checkpoint.every"),
    ("checkpoint.keep", 0, "checkpoint.keep"),
    ("checkpoint.resume", "sometimes", "checkpoint.resume"),
    ("checkpoint.resume", False, "checkpoint.resume"),
    ("logging.run_name", "", "logging.run_name"),
    ("logging.run_name", "a/b", "logging.run_name"),
    ("logging.run_name", 12, "logging.run_name"),
    ("logging.tensorboard", "off", "logging.tensorboard"),
    ("logging.progress", "no", "logging.progress"),
    ("plan.zero", True, "plan.zero"),
    ("plan.zero", 1.0, "plan.zero"),
    ("plan.tp", 0, "plan.tp"),
    ("plan.tp", 1 << 17, "plan.tp"),
    ("plan.pp", 2048, "plan.pp"),
    ("plan.pp", "2", "plan.pp"),
    ("plan.microbatches", 0, "plan.microbatches"),
    ("plan.stages", 5, "plan.stages"),
    ("plan.stages", [[0, 1, 2]], "plan.stages"),
    ("plan.stages", [["a", "b"]], "plan.stages"),
    ("plan.dp_shares", "3:1", "plan.dp_shares"),
    ("plan.dp_shares", [3, True], "plan.dp_shares"),
    ("plan.dp_shares", [3, -1], "plan.dp_shares"),
    ("plan.offload", "true", "plan.offload"),
    ("plan.schedule", "zigzag", "plan.schedule"),
    ("plan.preset", "fsdp", "plan.preset"),
    ("plan.file", 3, "plan.file"),
    ("model.dim", 2**20, "model.dim"),
    ("model.n_layers", 10**6, "model.n_layers"),
    ("data.seq_len", 2**30, "data.seq_len"),
]

RAW_CONFIGS = [  # (case id, file text, needle)
    ("alias-bomb", BOMB, "expands to more than"),
    ("python-tag", "model: !!python/object/apply:os.system ['true']\n", "not valid YAML"),
    ("undefined-alias", "model: *nowhere\n", "undefined alias"),
    ("broken-yaml", "model: {dim: [1, 2\n", "not valid YAML"),
    ("tab-indent", "model:\n\tdim: 32\n", "not valid YAML"),
    ("top-level-list", "- model\n- data\n", "mapping"),
    ("top-level-string", "just words\n", "mapping"),
    ("section-is-list", "model: [1, 2]\n", "model"),
    ("two-documents", "model: {}\n---\ndata: {}\n", "not valid YAML"),
    ("deep-nesting", "a: " + "[" * 5000 + "]" * 5000 + "\n", "config"),
]

SET_VALUES = [  # (case id, --set value, needle)
    ("no-equals", "optimizer.lr", "section.key=value"),
    ("empty-key", "=3", "section.key"),
    ("double-dot", "optimizer..lr=3", "section.key"),
    ("broken-yaml", "optimizer.betas=[0.9, 0.95", "not valid YAML"),
    ("undefined-alias", "optimizer.lr=*x", "undefined alias"),
    ("python-tag", "optimizer.lr=!!python/name:os.system", "not valid YAML"),
    ("alias-bomb-inline", "model.dim=" + BOMB.replace("\n", ", ").join("{}"), "model.dim"),
    ("unknown-key", "optimizer.learning_rate=1", "optimizer.learning_rate"),
    ("unknown-section", "optimiser.lr=1", "did you mean"),
    ("not-a-section", "train.steps.x=1", "not a section"),
    ("inf", "optimizer.lr=.inf", "optimizer.lr"),
    ("nan", "optimizer.lr=.nan", "optimizer.lr"),
    ("bool-for-int", "train.steps=true", "train.steps"),
    ("seed-beyond-64-bits", f"train.seed={2**70}", "train.seed"),
    ("timeout-inf", "train.timeout_s=.inf", "train.timeout_s"),
]


def _run_train(tmp: Path, config: object, extra: list[str], capsys) -> tuple[int, str, Path]:
    out_dir = tmp / "runs"
    path = tmp / "config.yaml"
    if isinstance(config, dict):
        config = {**config, "logging": {**config.get("logging", {}), "out_dir": str(out_dir)}}
        path.write_text(yaml.safe_dump(config))
    else:
        path.write_text(config)
    code = main(["train", str(path), "--nproc", "2", *extra])
    return code, capsys.readouterr().err.strip(), out_dir


def _assert_one_paragraph(code: int, err: str, needle: str) -> None:
    assert code == 2, err
    assert err.startswith("tessera: error:"), err
    assert "Traceback" not in err and "\n\n" not in err and err.count("\n") <= 1, err
    assert len(err) < 2000, f"the error is {len(err)} characters: it quotes too much input"
    assert needle in err, err


@pytest.mark.parametrize("field,value,needle", WRONG_TYPES, ids=[f"{f}={v!r}"[:40] for f, v, _ in WRONG_TYPES])
def test_config_values_of_the_wrong_type_or_range(field, value, needle, tmp_path: Path, capsys) -> None:
    code, err, out_dir = _run_train(tmp_path, changed(field, value), [], capsys)
    _assert_one_paragraph(code, err, needle)
    assert not out_dir.exists(), "a file was written before the config validated"


@pytest.mark.parametrize("case,text,needle", RAW_CONFIGS, ids=[c[0] for c in RAW_CONFIGS])
def test_config_files_that_are_not_valid_configs(case, text, needle, tmp_path: Path, capsys) -> None:
    code, err, _ = _run_train(tmp_path, text, [], capsys)
    _assert_one_paragraph(code, err, needle)
    assert str(tmp_path / "config.yaml") in err, "the error must name the file"


@pytest.mark.parametrize("case,value,needle", SET_VALUES, ids=[c[0] for c in SET_VALUES])
def test_malformed_set_values(case, value, needle, tmp_path: Path, capsys) -> None:
    code, err, out_dir = _run_train(tmp_path, GOOD, ["--set", value], capsys)
    _assert_one_paragraph(code, err, needle)
    assert not out_dir.exists()


# ------------------------------------------------------------------- files that are not what they say
def _odd_file(tmp: Path, kind: str) -> Path:
    path = tmp / "input.yaml"
    if kind == "binary":
        path.write_bytes(b"\x89PNG\r\n\x1a\n\x00\x00\xff\xfe" * 20)
    elif kind == "latin1":
        path.write_bytes("model: {dim: 32}  # caf\xe9\n".encode("latin-1"))
    elif kind == "directory":
        path.mkdir()
    elif kind == "huge":
        path.write_text("# padding\n" * 500_000)
    elif kind == "missing":
        pass
    return path


ODD_FILES = ["binary", "latin1", "directory", "huge", "missing"]
COMMANDS = {  # how each file role is handed to tessera
    "config": lambda p: ["train", str(p)],
    "plan": lambda p: ["plan", "check", str(p), "--world-size", "2"],
    "cluster": lambda p: ["cluster", "check", str(p)],
    "model-config-of-plan": lambda p: ["plan", "--model", str(p), "--cluster", "x.yaml", "--global-batch", "8"],
}


@pytest.mark.parametrize("role", list(COMMANDS))
@pytest.mark.parametrize("kind", ODD_FILES)
def test_files_that_are_not_utf8_yaml_are_named(role, kind, tmp_path: Path, capsys) -> None:
    path = _odd_file(tmp_path, kind)
    code = main(COMMANDS[role](path))
    err = capsys.readouterr().err.strip()
    _assert_one_paragraph(code, err, str(path))


# ------------------------------------------------------------------------------------ plan files
PLANS = [  # (case id, plan mapping or raw text, needle)
    ("dp-bool", {"dp": True}, "Plan.dp"),
    ("tp-string", {"tp": "2"}, "Plan.tp"),
    ("pp-float", {"pp": 2.0}, "Plan.pp"),
    ("zero-bool", {"zero": False}, "Plan.zero"),
    ("offload-int", {"offload": 1}, "Plan.offload"),
    ("precision-list", {"precision": ["bf16"]}, "Plan.precision"),
    ("precision-map", {"precision": {"a": 1}}, "Plan.precision"),
    ("pipeline-list", {"pipeline": [1, 2]}, "Plan.pipeline"),
    ("pipeline-string", {"pipeline": "1f1b"}, "Plan.pipeline"),
    ("stages-int", {"pp": 2, "pipeline": {"stages": 4}}, "Plan.pipeline.stages"),
    ("stages-flat", {"pp": 2, "pipeline": {"stages": [0, 1, 2]}}, "Plan.pipeline.stages"),
    ("microbatches-bool", {"pipeline": {"microbatches": True}}, "microbatches"),
    ("schedule-int", {"pipeline": {"schedule": 3}}, "schedule"),
    ("shares-map", {"dp_shares": {"a": 1}}, "Plan.dp_shares"),
    ("shares-string", {"dp_shares": "31"}, "Plan.dp_shares"),
    ("placement-int", {"placement": 5}, "Plan.placement"),
    ("placement-strings", {"placement": ["a", "b"]}, "Plan.placement"),
    ("placement-repeats", {"placement": [0, 0]}, "Plan.placement"),
    ("rank-devices-int", {"rank_devices": 3}, "Plan.rank_devices"),
    ("replicas-int", {"replicas": 2}, "Plan.replicas"),
    ("replicas-no-stages", {"replicas": [{"share": 1}]}, "stages"),
    ("replica-share-bool", {"replicas": [{"stages": [[0, 2]], "share": True}], "pipeline": {}}, "share"),
    ("unknown-field", {"zerro": 1}, "did you mean"),
    ("plan-is-list", "- 1\n- 2\n", "mapping"),
    ("plan-alias-bomb", BOMB, "expands to more than"),
    ("plan-python-tag", "tp: !!python/object/apply:os.system ['true']\n", "malformed"),
]


@pytest.mark.parametrize("case,plan,needle", PLANS, ids=[c[0] for c in PLANS])
def test_malformed_plan_files(case, plan, needle, tmp_path: Path, capsys) -> None:
    path = tmp_path / "plan.yaml"
    path.write_text(yaml.safe_dump(plan) if isinstance(plan, dict) else plan)
    code = main(["plan", "check", str(path), "--world-size", "2"])
    _assert_one_paragraph(code, capsys.readouterr().err.strip(), needle)


def test_plan_json_that_is_malformed(tmp_path: Path, capsys) -> None:
    path = tmp_path / "plan.json"
    path.write_text('{"tp": 2,')
    code = main(["plan", "check", str(path), "--world-size", "2"])
    _assert_one_paragraph(code, capsys.readouterr().err.strip(), "plan.json")


# --------------------------------------------------------------------------------- cluster files
NODE = {"name": "a", "devices": [{"type": "H100", "count": 2}]}
CLUSTERS = [  # (case id, cluster mapping, needle)
    ("nodes-map", {"nodes": {"a": 1}}, "nodes"),
    ("node-string", {"nodes": ["a"]}, "nodes[0]"),
    ("count-bool", {"nodes": [{**NODE, "devices": [{"type": "H100", "count": True}]}]}, "count"),
    ("count-huge", {"nodes": [{**NODE, "devices": [{"type": "H100", "count": 10**9}]}]}, "count"),
    ("type-int", {"nodes": [{**NODE, "devices": [{"type": 100, "count": 1}]}]}, "type"),
    ("devices-map", {"nodes": [{**NODE, "devices": {"type": "H100"}}]}, "devices"),
    ("region-list", {"nodes": [{**NODE, "region": ["eu"]}]}, "region"),
    ("device-types-list", {"nodes": [NODE], "device_types": ["X"]}, "device_types"),
    ("peak-inf", {"nodes": [NODE], "device_types": {"H100": {"peak_tflops": {"bf16": math.inf}}}}, "peak_tflops"),
    ("memory-nan", {"nodes": [NODE], "device_types": {"H100": {"memory_gib": math.nan}}}, "memory_gib"),
    ("links-list", {"nodes": [NODE], "links": [1]}, "links"),
    ("link-bandwidth-zero", {"nodes": [NODE], "links": {"inter_node": {"bandwidth_gbs": 0}}}, "bandwidth_gbs"),
    ("between-map", {"nodes": [NODE], "links": {"between": {"nodes": ["a", "b"]}}}, "between"),
    ("between-nested-list", {"nodes": [NODE], "links": {"between": [{"nodes": [["a"], "b"]}]}}, "between[0]"),
]


@pytest.mark.parametrize("case,cluster,needle", CLUSTERS, ids=[c[0] for c in CLUSTERS])
def test_malformed_cluster_files(case, cluster, needle, tmp_path: Path, capsys) -> None:
    path = tmp_path / "cluster.yaml"
    path.write_text(yaml.safe_dump(cluster))
    code = main(["cluster", "check", str(path)])
    _assert_one_paragraph(code, capsys.readouterr().err.strip(), needle)


# --------------------------------------------------------------------------- command-line arguments
ARGV = [  # (case id, argv with {config} for a good config file, needle)
    ("top-zero", ["plan", "--model", "{config}", "--cluster", "c.yaml", "--global-batch", "8", "--top", "0"], "--top"),
    ("global-batch-zero", ["plan", "--model", "{config}", "--cluster", "c.yaml", "--global-batch", "0"], "batch"),
    ("plan-without-cluster", ["plan", "--model", "{config}"], "--cluster"),
    ("nproc-zero", ["train", "{config}", "--nproc", "0"], "--nproc"),
    ("nproc-word", ["train", "{config}", "--nproc", "two"], "--nproc"),
    ("nnodes-negative", ["train", "{config}", "--nnodes", "-1"], "--nnodes"),
    ("restarts-negative", ["train", "{config}", "--max-restarts", "-2"], "--max-restarts"),
    ("world-size-zero", ["plan", "check", "{config}", "--world-size", "0"], "--world-size"),
    ("unknown-command", ["fly"], "invalid choice"),
    ("unknown-flag", ["train", "{config}", "--fast"], "--fast"),
    ("emulate-missing", ["train", "{config}", "--emulate", "/nonexistent/cluster.yaml"], "/nonexistent/cluster.yaml"),
    ("export-nothing", ["export", "/nonexistent/step_1"], "--out"),
    ("group-without-ft-groups", ["train", "{config}", "--group", "0"], "fault_tolerant: true"),
    ("lighthouse-bad-bind", ["lighthouse", "--bind", "nowhere"], "must be host:port"),
    ("export-not-a-checkpoint", ["export", "{tmp}", "--out", "{tmp}/m.safetensors"], "not a complete"),
]


@pytest.mark.parametrize("case,argv,needle", ARGV, ids=[c[0] for c in ARGV])
def test_malformed_command_lines(case, argv, needle, tmp_path: Path, capsys) -> None:
    config = tmp_path / "good.yaml"
    config.write_text(yaml.safe_dump(changed("logging.out_dir", str(tmp_path / "runs"))))
    argv = [a.replace("{config}", str(config)).replace("{tmp}", str(tmp_path)) for a in argv]
    try:
        code = main(argv)
    except SystemExit as exc:  # argparse's own exit, through our one-paragraph error()
        code = exc.code
    _assert_one_paragraph(code, capsys.readouterr().err.strip(), needle)


# ------------------------------------------------------------------ a checkpoint's meta.json
META = [  # (case id, meta.json text, needle); one reader serves resume, export and merge
    ("not-json", '{"step": 2, "world_size":', "not a JSON mapping"),
    ("a-list", "[2, 4]", "not a JSON mapping"),
    ("no-world-size", '{"step": 2}', "world_size=None is not a count"),
    ("groups-a-word", '{"step": 2, "world_size": 4, "groups": "two"}', "groups='two' is not a count"),
    ("groups-zero", '{"step": 2, "world_size": 4, "groups": 0}', "groups=0 is not a count"),
]


@pytest.mark.parametrize("case,text,needle", META, ids=[c[0] for c in META])
def test_a_corrupted_checkpoint_meta_is_refused_naming_the_file(case, text, needle, tmp_path: Path, capsys) -> None:
    step = tmp_path / "step_00000002"
    step.mkdir()
    (step / "meta.json").write_text(text)
    code = main(["export", str(step), "--out", str(tmp_path / "m.safetensors")])
    err = capsys.readouterr().err.strip()
    _assert_one_paragraph(code, err, needle)
    assert str(step / "meta.json") in err


# --------------------------------------------------------------------- models that cannot be built
def test_a_model_too_large_for_this_machine_is_refused_before_launch(tmp_path: Path, capsys) -> None:
    """~17.7B parameters: each rank would build 66 GiB before sharding; the estimate refuses it."""
    big = changed("model.dim", 8192)
    big["model"].update(n_layers=64, n_heads=64, n_kv_heads=8)
    code, err, out_dir = _run_train(tmp_path, big, [], capsys)
    _assert_one_paragraph(code, err, "GiB is available")
    assert "model.dim=8192" in err and not out_dir.exists()


def test_an_hf_config_that_is_not_json_is_refused_before_launch(tmp_path: Path, capsys) -> None:
    broken = tmp_path / "config.json"
    broken.write_text('{"model_type": "llama", "hidden_size": 32,')
    cfg = changed("model.kind", "hf_config")
    cfg["model"] = {"kind": "hf_config", "hf_config": str(broken)}
    code, err, _ = _run_train(tmp_path, cfg, [], capsys)
    _assert_one_paragraph(code, err, f"model.hf_config '{broken}'")


# ------------------------------------------------------------------------------------ output paths
def test_output_paths_that_cannot_be_written(tmp_path: Path, capsys) -> None:
    """logging.out_dir a file or under a file; plan --out a directory; detect --out existing."""
    a_file = tmp_path / "file"
    a_file.write_text("x")
    cases = [
        (["train", "{config}", "--set", f"logging.out_dir={a_file}"], "is a file"),
        (["train", "{config}", "--set", f"logging.out_dir={a_file}/runs"], "lies under"),
        (["cluster", "detect", "--out", str(a_file)], "already exists"),
        (["cluster", "detect", "--out", str(tmp_path)], "is a directory"),
        (["cluster", "detect", "--out", f"{a_file}/c.yaml"], "lies under"),
    ]
    config = tmp_path / "good.yaml"
    config.write_text(yaml.safe_dump(changed("logging.out_dir", str(tmp_path / "runs"))))
    for argv, needle in cases:
        code = main([a.replace("{config}", str(config)) for a in argv])
        _assert_one_paragraph(code, capsys.readouterr().err.strip(), needle)
    assert a_file.read_text() == "x"


def test_a_read_only_output_directory_is_refused_before_launch(tmp_path: Path, capsys) -> None:
    """A read-only filesystem (root ignores permission bits, not a read-only mount)."""
    import subprocess

    ro = tmp_path / "ro"
    ro.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=64k", "tmpfs", str(ro)], check=True)
    try:
        code, err, _ = _run_train(tmp_path, GOOD, ["--set", f"logging.out_dir={ro}/runs"], capsys)
        _assert_one_paragraph(code, err, "is not writable")
    finally:
        subprocess.run(["umount", "-l", str(ro)], check=False)


# ------------------------------------------------------- --emulate cluster files, checkpoint trainer state
EMULATED = [  # (case id, cluster mapping, needle): tessera train --nproc 2 --emulate it (issue 33, item 8)
    ("fewer-devices-than-ranks", {"nodes": [{"name": "a", "devices": [{"type": "H100", "count": 1}]}]},
     "describes 1 devices, but the launch's ranks play device 1 too"),
    ("no-fp32-peak", {"nodes": [{"name": "a", "devices": [{"type": "X", "count": 2}]}],
                      "device_types": {"X": {"peak_tflops": {"bf16": 100}, "memory_gib": 8, "bandwidth_gbs": 500}}},
     "device type 'X' gives no peak for fp32, which emulation paces it by: add device_types.X.peak_tflops.fp32"),
]  # fmt: skip


@pytest.mark.parametrize("case,cluster,needle", EMULATED, ids=[c[0] for c in EMULATED])
def test_emulated_cluster_files_the_ranks_cannot_play(case, cluster, needle, tmp_path: Path, capsys) -> None:
    (tmp_path / "cluster.yaml").write_text(yaml.safe_dump(cluster))
    code, err, out_dir = _run_train(tmp_path, GOOD, ["--emulate", str(tmp_path / "cluster.yaml")], capsys)
    _assert_one_paragraph(code, err, needle)
    assert not out_dir.exists()


TRAINER_STATES = [  # (case id, what trainer.pt holds, needle): tessera train --resume on it
    ("empty", {}, "step=None, epoch=None, batch_in_epoch=None, scheduler=None"),
    ("a-list", [1, 2], "([1, 2]; it needs step, epoch, batch_in_epoch, scheduler)"),
    ("negative-step", {"step": -4, "epoch": 0, "batch_in_epoch": 0, "scheduler": {}}, "step=-4"),
    ("step-a-word", {"step": "8", "epoch": 0, "batch_in_epoch": 0, "scheduler": {}}, "step='8'"),
]


@pytest.mark.parametrize("case,state,needle", TRAINER_STATES, ids=[c[0] for c in TRAINER_STATES])
def test_a_checkpoint_whose_trainer_state_is_not_one_is_refused_before_launch(
    case, state, needle, tmp_path: Path, capsys
) -> None:
    import torch
    from test_run_directories import fake_checkpoint

    step = fake_checkpoint(tmp_path / "runs" / GOOD["logging"]["run_name"], 8, "old")
    torch.save(state, step / "trainer.pt")
    code, err, _ = _run_train(tmp_path, GOOD, ["--resume"], capsys)
    _assert_one_paragraph(code, err, needle)
    assert f"'{step / 'trainer.pt'}' is corrupted" in err and "--overwrite" in err
