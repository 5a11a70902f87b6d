"""Train-issue acceptance 1-3: exact resume, resharding across layouts, crash during save."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from tessera.checkpoint import latest_checkpoint
from tessera.config import parse_config
from tessera.testing import run_ranks


def tiny_config(
    out_dir: Path, steps: int, every: int, plan: dict, stop_at: int | None = None, kind: str = "llama"
) -> dict:
    return {
        "model": {"kind": kind, "dim": 32, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "ffn_dim": 64},
        "data": {"seq_len": 32, "max_bytes": 60_000},
        "optimizer": {"lr": 1e-3},
        "schedule": {"warmup_steps": 2},
        "plan": plan,
        "train": {"steps": steps, "stop_at": stop_at, "global_batch_size": 8, "log_every": 1, "sample_bytes": 0},
        "checkpoint": {"every": every, "keep": 5},
        "logging": {"run_name": "t", "out_dir": str(out_dir), "progress": False, "tensorboard": False},
    }


def train_worker(config: dict, fault: str | None = None) -> dict:
    import os

    if fault:
        os.environ["TESSERA_FAULT"] = fault
    from tessera.train.trainer import train

    return train(parse_config(config))


def train_ranks(
    world: int,
    out_dir: Path,
    steps: int,
    every: int,
    plan: dict,
    fault: str | None = None,
    stop_at: int | None = None,
    kind: str = "llama",
) -> dict:
    return run_ranks(train_worker, world, tiny_config(out_dir, steps, every, plan, stop_at, kind), fault)[0]


def checkpoint_tensors(
    path: Path, tmp: Path, prefixes: tuple[str, ...] = ("model.", "optim.state.")
) -> dict[str, torch.Tensor]:
    """The tensors of a DCP checkpoint under ``prefixes``, flattened to 'model.x' / 'optim.state.x.exp_avg' keys."""
    out = tmp / f"{path.parent.parent.name}-{path.parent.name}-{path.name}.pt"
    dcp_to_torch_save(str(path), str(out))
    flat: dict[str, torch.Tensor] = {}

    def walk(prefix: str, node: object) -> None:
        if isinstance(node, torch.Tensor):
            flat[prefix] = node
        elif isinstance(node, dict):
            for k, v in node.items():
                walk(f"{prefix}.{k}" if prefix else str(k), v)

    walk("", torch.load(out, weights_only=False))
    return {k: v for k, v in flat.items() if k.startswith(prefixes)}


def ckpt(run: Path, step: int) -> Path:
    return run / "t" / "checkpoints" / f"step_{step:08d}"


def test_resume_is_bitwise_identical(tmp_path: Path) -> None:
    plan = {"preset": "zero", "zero": 3}
    straight, split = tmp_path / "straight", tmp_path / "split"
    train_ranks(2, straight, steps=10, every=0, plan=plan)
    train_ranks(2, split, steps=10, every=0, plan=plan, stop_at=5)  # stop: the job ends after step 5
    summary = train_ranks(2, split, steps=10, every=0, plan=plan)
    assert summary["resumed_from"] and summary["resumed_from"].endswith("step_00000005")
    a, b = checkpoint_tensors(ckpt(straight, 10), tmp_path), checkpoint_tensors(ckpt(split, 10), tmp_path)
    assert a.keys() == b.keys() and any(k.endswith("exp_avg_sq") for k in a)
    for k in a:
        assert torch.equal(a[k], b[k]), f"{k} differs after stop + resume"


LAYOUTS = {
    "ddp2": (2, {"preset": "ddp"}),
    "zero1x2": (2, {"preset": "zero", "zero": 1}),
    "zero3x2": (2, {"preset": "zero", "zero": 3}),
    "zero3x4": (4, {"preset": "zero", "zero": 3}),
    "shares3-1": (2, {"preset": "zero", "zero": 2, "dp_shares": [3, 1]}),
}
MODEL_PARALLEL = {
    "pp2xdp2-zero1": (4, {"preset": "zero", "zero": 1, "pp": 2, "microbatches": 2, "schedule": "1f1b"}, "llama"),
    "tp2xdp2-zero1": (4, {"preset": "zero", "zero": 1, "tp": 2}, "llama"),
    # GPT-2's fused q|k|v weight is a strided tp shard, stored gathered over tp (DCP wants one chunk per rank).
    "gpt2-tp2xdp2-zero3": (4, {"preset": "zero", "zero": 3, "tp": 2}, "hf_gpt2"),
}
# every run the two resharding tests compare: name -> (world, plan, model kind)
SOURCES = {
    **{name: (world, plan, "llama") for name, (world, plan) in LAYOUTS.items()},
    **MODEL_PARALLEL,
    "gpt2-ddp2": (2, LAYOUTS["ddp2"][1], "hf_gpt2"),
}
# (source, target) pairs: every layout into every other, each model-parallel layout to DDP and back
PAIRS = [(s, t) for s in LAYOUTS for t in LAYOUTS if s != t]
for _name, (_, _, _kind) in MODEL_PARALLEL.items():
    _ddp = "ddp2" if _kind == "llama" else "gpt2-ddp2"
    PAIRS += [(_name, _ddp), (_ddp, _name)]


def train_each(configs: list[dict]) -> list[dict]:
    """Train one config after another in this process group (one launch for many short runs)."""
    from tessera.train.trainer import train

    return [train(parse_config(config)) for config in configs]


def train_runs_by_world(runs: dict[str, tuple[Path, str]], steps: int) -> dict[str, dict]:
    """Train ``runs`` (name -> (out_dir, source layout name)), one launch per world size."""
    summaries = {}
    for world in sorted({SOURCES[layout][0] for _, layout in runs.values()}):
        mine = [name for name, (_, layout) in runs.items() if SOURCES[layout][0] == world]
        configs = [
            tiny_config(runs[name][0], steps, 1, SOURCES[runs[name][1]][1], kind=SOURCES[runs[name][1]][2])
            for name in mine
        ]
        results = run_ranks(train_each, world, configs, timeout_s=600)[0]
        summaries.update(zip(mine, results))
    return summaries


@pytest.fixture(scope="module")
def saved_runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Each source layout trains 3 steps, checkpointing at 1, 2 and 3."""
    runs = {name: (tmp_path_factory.mktemp(name), name) for name in SOURCES}
    train_runs_by_world(runs, steps=3)
    return {name: out for name, (out, _) in runs.items()}


@pytest.fixture(scope="module")
def resumed_runs(saved_runs: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> dict[tuple, Path]:
    """Each pair's target layout loads the source's step-2 checkpoint and trains step 3."""
    runs = {}
    for source, target in PAIRS:
        run = tmp_path_factory.mktemp(f"{source}-to-{target}")
        (run / "t" / "checkpoints").mkdir(parents=True)
        shutil.copytree(ckpt(saved_runs[source], 2), ckpt(run, 2))
        runs[f"{source} -> {target}"] = (run, target)
    summaries = train_runs_by_world(runs, steps=3)
    for name, summary in summaries.items():
        assert summary["resumed_from"] and summary["resumed_from"].endswith("step_00000002"), name
    return {pair: runs[f"{pair[0]} -> {pair[1]}"][0] for pair in PAIRS}


def assert_same_step3(source: str, target: str, saved_runs: dict, resumed_runs: dict, tmp_path: Path) -> None:
    """The target's step-3 model and optimizer state, continued from the source's step 2, equal the
    source's own step 3."""
    want = checkpoint_tensors(ckpt(saved_runs[source], 3), tmp_path)
    got = checkpoint_tensors(ckpt(resumed_runs[source, target], 3), tmp_path)
    assert got.keys() == want.keys(), f"{source} -> {target}: {sorted(got.keys() ^ want.keys())}"
    for k in want:
        torch.testing.assert_close(
            got[k], want[k], rtol=1e-5, atol=1e-6, msg=lambda m, k=k: f"{source} -> {target}, {k}: {m}"
        )


@pytest.mark.parametrize("source", list(LAYOUTS))
def test_checkpoint_loads_under_every_other_layout(
    source: str, saved_runs: dict[str, Path], resumed_runs: dict, tmp_path: Path
) -> None:
    """The source's step-2 checkpoint, loaded under each other layout that trains step 3 there,
    reaches the source's own step-3 model and optimizer state."""
    assert any(k.endswith("exp_avg_sq") for k in checkpoint_tensors(ckpt(saved_runs[source], 3), tmp_path))
    for target in LAYOUTS:
        if target != source:
            assert_same_step3(source, target, saved_runs, resumed_runs, tmp_path)


@pytest.mark.parametrize("layout", list(MODEL_PARALLEL))
def test_model_parallel_checkpoints_resume_under_ddp_and_back(
    layout: str, saved_runs: dict[str, Path], resumed_runs: dict, tmp_path: Path
) -> None:
    """tessera train under a pipeline or tensor-parallel layout: its step-2 checkpoint continues
    under DDP, and DDP's continues under that layout, each reaching the other's step-3 model
    and optimizer state (ZeRO-1's optimizer state is DTensor-shaped under tp)."""
    ddp = "ddp2" if MODEL_PARALLEL[layout][2] == "llama" else "gpt2-ddp2"
    assert_same_step3(layout, ddp, saved_runs, resumed_runs, tmp_path)
    assert_same_step3(ddp, layout, saved_runs, resumed_runs, tmp_path)


def test_crash_during_save_keeps_the_last_good_checkpoint(tmp_path: Path) -> None:
    plan = {"preset": "zero", "zero": 2}
    run = tmp_path / "run"
    with pytest.raises(RuntimeError, match="exited without a result"):
        train_ranks(2, run, steps=4, every=2, plan=plan, fault="save:4")
    assert latest_checkpoint(run / "t" / "checkpoints") == ckpt(run, 2)
    assert (run / "t" / "checkpoints" / "step_00000004.tmp").is_dir()  # the half-written save, never used
    summary = train_ranks(2, run, steps=4, every=2, plan=plan)
    assert summary["resumed_from"].endswith("step_00000002")
    reference = tmp_path / "reference"
    train_ranks(2, reference, steps=4, every=2, plan=plan)
    a, b = checkpoint_tensors(ckpt(run, 4), tmp_path), checkpoint_tensors(ckpt(reference, 4), tmp_path)
    for k in a:
        assert torch.equal(a[k], b[k]), k
