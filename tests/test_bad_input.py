"""Train-issue acceptance 6: malformed input gives one paragraph, exit code 2, no traceback, no file written."""

from __future__ import annotations

import hashlib
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tessera.cli import main

GOOD = {
    "model": {"dim": 32, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "ffn_dim": 64},
    "data": {"seq_len": 32, "max_bytes": 40_000},
    "train": {"steps": 2, "global_batch_size": 8, "sample_bytes": 0},
    "checkpoint": {"every": 0},
    "logging": {"run_name": "bad", "progress": False, "tensorboard": False},
}


def with_change(path: str, value: object) -> dict:
    cfg = yaml.safe_load(yaml.safe_dump(GOOD))
    node = cfg
    *parents, last = path.split(".")
    for key in parents:
        node = node.setdefault(key, {})
    node[last] = value
    return cfg


def empty_file(tmp: Path) -> str:
    (tmp / "empty.txt").write_text("")
    return str(tmp / "empty.txt")


# (case id, config dict or raw text, extra CLI args, text the error must contain)
CASES = [
    ("unknown-section", {**GOOD, "modle": {}}, [], 'did you mean "model"'),
    ("unknown-key", with_change("optimizer.lrr", 0.1), [], 'did you mean "optimizer.lr"'),
    ("wrong-type-lr", with_change("optimizer.lr", "fast"), [], "optimizer.lr"),
    ("negative-dim", with_change("model.dim", -8), [], "model.dim"),
    ("zero-steps", with_change("train.steps", 0), [], "train.steps"),
    ("negative-batch", with_change("train.global_batch_size", -4), [], "train.global_batch_size"),
    ("heads-not-dividing", with_change("model.n_heads", 3), [], "n_heads"),
    ("kv-heads-not-dividing", with_change("model.n_kv_heads", 3), [], "n_kv_heads"),
    ("missing-data-path", with_change("data.paths", ["/nonexistent/corpus.txt"]), [], "/nonexistent/corpus.txt"),
    ("glob-matches-nothing", with_change("data.paths", ["/nonexistent/*.txt"]), [], "matches no file"),
    ("empty-corpus", "EMPTY_CORPUS", [], "too few"),
    ("bad-precision", with_change("plan.precision", "fp4"), [], "plan.precision"),
    ("fp8-on-cpu", with_change("plan.precision", "fp8"), [], "plan.fp8_emulate: true"),
    ("zero-stage-5", with_change("plan.zero", 5), [], "plan.zero"),
    ("shares-count", with_change("plan.dp_shares", [1, 1, 1]), [], "dp_shares"),
    ("shares-zero", with_change("plan.dp_shares", [1, 0]), [], "dp_shares"),
    ("batch-not-divisible", with_change("plan.dp_shares", [2, 1]), [], "global_batch_size=8"),
    ("unknown-schedule", with_change("schedule.kind", "step"), [], "schedule.kind"),
    ("bad-run-name", with_change("logging.run_name", "../escape"), [], "logging.run_name"),
    ("missing-plan-file", with_change("plan.file", "/nonexistent/plan.yaml"), [], "/nonexistent/plan.yaml"),
    ("not-a-mapping", "- just\n- a list\n", [], "mapping"),
    ("invalid-yaml", "model: {dim: [1, 2\n", [], "not valid YAML"),
    ("set-without-equals", GOOD, ["--set", "optimizer.lr"], "section.key=value"),
    ("set-unknown-key", GOOD, ["--set", "optimizer.learning_rate=1"], "optimizer.learning_rate"),
    ("hf-config-missing", with_change("model.kind", "hf_config"), [], "model.hf_config"),
    (
        "hf-config-not-found",
        {**GOOD, "model": {"kind": "hf_config", "hf_config": "/nonexistent/config.json"}},
        [],
        "does not exist",
    ),
    ("negative-peak", with_change("train.peak_tflops", {"cpu": -1.0}), [], "train.peak_tflops"),
    (
        "compiled-expert-parallel",
        {**GOOD, "model": {**GOOD["model"], "moe": {"experts": 4}}, "plan": {"compile": "blocks", "ep": 2}},
        [],
        "Plan.compile='blocks' with Plan.ep=2",
    ),
    ("nproc-too-many-for-batch", with_change("train.global_batch_size", 1), [], "global_batch_size"),
]


@pytest.mark.parametrize("case,config,extra,needle", CASES, ids=[c[0] for c in CASES])
def test_bad_config_is_one_clear_paragraph(case, config, extra, needle, tmp_path: Path, capsys) -> None:
    out_dir = tmp_path / "runs"
    path = tmp_path / "config.yaml"
    if config == "EMPTY_CORPUS":
        config = with_change("data.paths", [empty_file(tmp_path)])
    if isinstance(config, dict):
        config = yaml.safe_load(yaml.safe_dump(config))
        config.setdefault("logging", {})["out_dir"] = str(out_dir)
        path.write_text(yaml.safe_dump(config))
    else:
        path.write_text(config)
    code = main(["train", str(path), "--nproc", "2", *extra])
    err = capsys.readouterr().err.strip()
    assert code == 2, err
    assert err.startswith("tessera: error:") and "\n\n" not in err and "Traceback" not in err, err
    assert needle in err, err
    assert not out_dir.exists(), "a file was written before the config validated"


def test_missing_config_file(tmp_path: Path, capsys) -> None:
    assert main(["train", str(tmp_path / "nope.yaml")]) == 2
    assert "does not exist" in capsys.readouterr().err


def _tree_digest(root: Path) -> dict[str, str]:
    """Every file of the run but its failure logs (a failed launch adds one, with the tracebacks)."""
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in root.rglob("*")
        if p.is_file() and "logs" not in p.relative_to(root).parts
    }


def _launch(config: Path, *sets: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "tessera.cli", "train", str(config), "--nproc", "2", *(f"--set={s}" for s in sets)]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module")
def trained_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("trained")
    config = root / "config.yaml"
    config.write_text(yaml.safe_dump(with_change("logging.out_dir", str(root / "runs"))))
    proc = _launch(config)
    assert proc.returncode == 0, proc.stderr
    return config


def _refused_before_launch(config: Path, capsys: pytest.CaptureFixture, *sets: str) -> str:
    """``tessera train`` on ``config`` refuses in one paragraph, writing nothing: its error."""
    runs = config.parent / "runs"
    before, files = _tree_digest(runs), sorted(runs.rglob("*"))
    code = main(["train", str(config), "--nproc", "2", *(f"--set={s}" for s in sets)])
    err = capsys.readouterr().err.strip()
    assert code == 2, err
    assert err.startswith("tessera: error:") and "Traceback" not in err and "\n\n" not in err, err
    assert _tree_digest(runs) == before, "a refused resume changed files"
    assert sorted(runs.rglob("*")) == files, "ranks were launched (they wrote a failure log)"
    return err


def test_checkpoint_of_another_model_is_refused_before_launch(trained_run: Path, capsys) -> None:
    """Its shapes are read from the checkpoint's metadata against the model built on meta: no rank starts."""
    err = _refused_before_launch(trained_run, capsys, "model.dim=64", "train.steps=3")
    assert "different model" in err and "checkpoint (32,) vs model (64,)" in err, err


def test_truncated_checkpoint_is_refused_before_launch(trained_run: Path, capsys) -> None:
    """A shard cut short is found from its size against the metadata's offsets, naming the file; the ranks
    check the same before they read (a checkpoint cut short after the launch checked it)."""
    from tessera.checkpoint import CheckpointError, latest_checkpoint
    from tessera.checkpoint.load import check_complete

    newest = latest_checkpoint(trained_run.parent / "runs" / "bad" / "checkpoints")
    assert newest is not None
    check_complete(newest)  # whole, as saved
    shard = max(newest.rglob("*.distcp"), key=lambda p: p.stat().st_size)
    whole = shard.read_bytes()
    shard.write_bytes(whole[:100])  # truncated on disk
    try:
        err = _refused_before_launch(trained_run, capsys, "train.steps=3")
        assert "corrupted or incomplete" in err and shard.name in err and "holds 100 bytes" in err, err
        with pytest.raises(CheckpointError, match=shard.name):
            check_complete(newest)
    finally:
        shard.write_bytes(whole)  # the tests below copy this checkpoint


def test_shipped_example_configs_validate(tmp_path: Path) -> None:
    """Every example validates; the fine-tuning one names the user's own model and data, so those two paths
    are set to a saved model and a jsonl file made here."""
    from tessera.config import load_config
    from tessera.models import hf

    examples = sorted((Path(__file__).resolve().parent.parent / "examples").glob("*.yaml"))
    assert len(examples) >= 3
    hf.llama(n_layer=1, hidden=32, n_head=4, n_kv_head=2, ffn=64, vocab_size=300, seq_len=32).save_pretrained(
        tmp_path / "llama"
    )
    (tmp_path / "train.jsonl").write_text('{"prompt": "p", "response": "r"}\n')
    yours = [f"model.pretrained={tmp_path / 'llama'}", f"data.instructions=[{tmp_path / 'train.jsonl'}]"]
    for path in examples:
        load_config(path, yours if path.name.startswith("finetune") else [])


def test_every_field_of_the_plan_is_a_config_key_and_arrives() -> None:
    """The config's plan: section is the Plan's own schema: every Plan field (the pipeline's flat)
    set to a value other than its default comes through the config unchanged, and the same
    holds for the Hybrid preset's pass-through fields."""
    import tessera
    from tessera.config import parse_config, plan_from_config

    rich = tessera.Plan(
        dp=2, tp=2, pp=2, sp=2, ep=2, sp_mode="split_gather", zero=1, offload=True, precision="fp8",
        fp8_recipe="rowwise", fp8_emulate=True, dp_shares=(3, 1),
        expert_shares=(3, 1), compile="blocks",
        pipeline={"stages": [[0, 1], [1, 2]], "microbatches": 4, "schedule": "gpipe"}, recompute="full",
        loss_parallel=True, device="cpu", rank_devices=("a",) * 16, placement=tuple(range(16)),
    )  # fmt: skip
    defaults = tessera.Plan().to_dict()
    section = {k: v for k, v in rich.to_dict().items() if k not in ("pipeline", "replicas")}
    section.update(rich.to_dict()["pipeline"])
    unset = {k for k, v in rich.to_dict().items() if v == defaults[k]} - {"pipeline"}
    # replicas: checked below; groups: `tessera train` refuses them until it checkpoints them (test_groups.py)
    assert unset == {"replicas", "groups"}, f"give these fields a non-default value here: {unset}"
    assert plan_from_config(parse_config({"plan": section}).plan) == rich
    hybrid = tessera.Hybrid(dp=2, tp=2, sp="split_gather", zero=1, offload=True, placement=tuple(range(4)))
    assert hybrid.offload and hybrid.placement == tuple(range(4))
    replicas = {"replicas": [{"stages": [[0, 2]], "share": 2}, {"stages": [[0, 1], [1, 2]]}], "microbatches": 2}
    assert plan_from_config(parse_config({"plan": {**replicas, "preset": "ddp"}}).plan).replicas[0].share == 2


def test_every_plan_field_of_the_config_reaches_the_plan() -> None:
    """plan_from_config once dropped plan.sp silently; every field must arrive."""
    from tessera.config import parse_config, plan_from_config

    section = {
        "tp": 2,
        "sp": 2,
        "sp_mode": "split_gather",
        "loss_parallel": True,
        "pp": 2,
        "microbatches": 4,
        "schedule": "gpipe",
        "stages": [[0, 1], [1, 2]],
        "recompute": "full",
    }
    plan = plan_from_config(parse_config({"plan": section}).plan)
    got = {k: getattr(plan, k) for k in ("tp", "sp", "sp_mode", "loss_parallel", "pp", "recompute")}
    assert got == {k: section[k] for k in got}
    assert plan.pipeline.microbatches == 4 and plan.pipeline.schedule == "gpipe"
    assert plan.pipeline.stages == ((0, 1), (1, 2))


class _RunsCode:
    """Unpickling this calls ``pathlib.Path.touch(marker)``: proof that code ran."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (self.marker,))


def resume_from(checkpoint: str, refusals: list[tuple[str, int, str]]) -> None:
    """Rebuild the trained run's model and optimizer, then load ``checkpoint`` into them; first, each of
    ``refusals`` (a checkpoint, the model dim to build, the error expected) must be refused by the ranks."""
    import torch

    import tessera
    from tessera.checkpoint import CheckpointError, load_checkpoint
    from tessera.config import parse_config
    from tessera.models.build import build_model
    from tessera.train.optimizer import build_optimizer

    def boosted(dim: int):
        cfg = parse_config({**with_change("logging.out_dir", "unused"), "model": {**GOOD["model"], "dim": dim}})
        model = build_model(cfg)
        return tessera.Booster(tessera.Plan(zero=2)).boost(model, build_optimizer(cfg, model.parameters()))

    for path, dim, needle in refusals:
        with pytest.raises(CheckpointError, match=needle):
            load_checkpoint(path, *boosted(dim))
    load_checkpoint(checkpoint, *boosted(32))
    torch.distributed.barrier()


def test_checkpoints_the_ranks_refuse(trained_run: Path, tmp_path: Path) -> None:
    """What the ranks themselves refuse (a checkpoint may change after the launch checked it): another
    model's, one with a shard cut short, and a crafted trainer.pt (a pickle whose loading runs code), whose
    code never runs."""
    import shutil

    import torch

    from tessera.testing import run_ranks

    newest = sorted((trained_run.parent / "runs" / "bad" / "checkpoints").iterdir())[-1]
    crafted, truncated = tmp_path / "crafted", tmp_path / "truncated"
    shutil.copytree(newest, crafted)
    shutil.copytree(newest, truncated)
    shard = max(truncated.rglob("*.distcp"), key=lambda p: p.stat().st_size)
    shard.write_bytes(shard.read_bytes()[:100])
    marker = tmp_path / "code-ran"
    torch.save({"step": _RunsCode(marker)}, crafted / "trainer.pt")
    refusals = [(str(newest), 64, r"different model.*checkpoint \(32,\) vs model \(64,\)"), (str(truncated), 32,
                f"{shard.name}' holds 100 bytes")]  # fmt: skip
    with pytest.raises(RuntimeError, match="not plain data") as info:
        run_ranks(resume_from, 2, str(crafted), refusals)
    assert "trainer.pt" in str(info.value) and "CheckpointError" in str(info.value)
    assert not marker.exists(), "loading the checkpoint ran the planted code"
    torch.load(crafted / "trainer.pt", weights_only=False)  # the planted file does run code when unpickled
    assert marker.exists()


def test_crafted_dcp_metadata_is_refused(trained_run: Path, tmp_path: Path) -> None:
    """torch's DCP reads .metadata with plain pickle: ours builds only metadata records."""
    import pickle
    import shutil

    from tessera.checkpoint import CheckpointError
    from tessera.export import load_full_model_state

    newest = sorted((trained_run.parent / "runs" / "bad" / "checkpoints").iterdir())[-1]
    crafted = tmp_path / newest.name
    shutil.copytree(newest, crafted)
    marker = tmp_path / "code-ran"
    (crafted / ".metadata").write_bytes(pickle.dumps(_RunsCode(marker)))
    with pytest.raises(CheckpointError, match="not plain data"):
        load_full_model_state(crafted)
    assert not marker.exists()


def test_crafted_state_entry_is_refused(tmp_path: Path) -> None:
    """Non-tensor state entries (DCP's default planner: torch.load(weights_only=False)) are read as data."""
    import io
    from types import SimpleNamespace

    import torch

    from tessera.checkpoint import CheckpointError
    from tessera.checkpoint.readers import DataOnlyLoadPlanner

    planner = DataOnlyLoadPlanner(flatten_state_dict=False)
    planner.state_dict = {}
    item = SimpleNamespace(dest_index=SimpleNamespace(fqn="optim.param_groups"))
    plain, crafted = io.BytesIO(), io.BytesIO()
    torch.save([{"lr": 0.1, "params": ["w"]}], plain)
    marker = tmp_path / "code-ran"
    torch.save(_RunsCode(marker), crafted)
    planner.load_bytes(item, io.BytesIO(plain.getvalue()))
    assert planner.state_dict["optim.param_groups"] == [{"lr": 0.1, "params": ["w"]}]
    with pytest.raises(CheckpointError, match="not plain data"):
        planner.load_bytes(item, io.BytesIO(crafted.getvalue()))
    assert not marker.exists()
