"""`make demo`'s job (examples/demo.yaml, shortened) runs end to end through torchrun and learns."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from tracker_files import mlflow_history, tensorboard_scalars, wandb_history

REPO = Path(__file__).resolve().parent.parent


def test_demo_config_trains_and_writes_its_outputs(tmp_path: Path) -> None:
    cmd = [
        sys.executable,
        "-m",
        "tessera.cli",
        "train",
        str(REPO / "examples" / "demo.yaml"),
        "--nproc",
        "2",
        "--set",
        "train.steps=30",
        "--set",
        "data.seq_len=64",
        "--set",
        "train.sample_bytes=40",
        "--set",
        "checkpoint.every=15",
        "--set",
        f"logging.out_dir={tmp_path}",
        "--set",
        "logging.trackers=[tensorboard, wandb, mlflow]",
    ]
    env = {**os.environ, "WANDB_MODE": "offline", "HOME": str(tmp_path)}  # no W&B login, no network here
    env.pop("MLFLOW_TRACKING_URI", None)
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    m = re.search(r"loss ([\d.]+) -> ([\d.]+) over steps 1-30", proc.stdout)
    assert m, proc.stdout + proc.stderr
    first, last = map(float, m.groups())
    assert last < first - 1.0, f"the demo did not learn: {first} -> {last}"
    assert "sample:\ndef " in proc.stdout
    # The opening banner (issue 33, item 5): model, size, plan, ranks, where the run writes; then plain log lines
    assert proc.stdout.startswith("tessera: llama (0.85M parameters); plan dp=2, ZeRO-2, fp32; 2 ranks; 30 steps")
    assert (f"tessera: writing {tmp_path / 'demo'}/ (metrics.jsonl, loss.png, checkpoints/, TensorBoard events, "
            "W&B run in wandb/, MLflow run)") in proc.stdout  # fmt: skip
    assert "step 30/30  loss " in proc.stdout and not proc.stderr.strip(), proc.stderr  # no library noise
    run = tmp_path / "demo"
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert records[-1]["step"] == 30 and {"loss", "tokens_per_s", "step_time_s", "model_state_bytes_rank0"} <= set(
        records[-1]
    )
    # Each tracker (issue 33, item 6), read through its own files, holds the losses metrics.jsonl holds.
    losses = {r["step"]: r["loss"] for r in records if "loss" in r}
    assert tensorboard_scalars(run, "loss") == pytest.approx(losses)
    assert wandb_history(run, "loss") == pytest.approx(losses)
    assert mlflow_history(run, "loss") == (pytest.approx(losses), ["demo"])
    assert (run / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step_00000015", "step_00000030"]


def test_plan_check_cli(tmp_path: Path) -> None:
    import tessera

    path = tmp_path / "plan.yaml"
    tessera.ZeRO(stage=3, dp_shares=(3, 1)).save(path)
    ok = subprocess.run(
        [sys.executable, "-m", "tessera.cli", "plan", "check", str(path), "--world-size", "2"],
        capture_output=True,
        text=True,
    )
    assert ok.returncode == 0 and "valid for 2 ranks" in ok.stdout, ok.stderr
    bad = subprocess.run(
        [sys.executable, "-m", "tessera.cli", "plan", "check", str(path), "--world-size", "4"],
        capture_output=True,
        text=True,
    )
    assert bad.returncode == 2 and "dp_shares" in bad.stderr and "Traceback" not in bad.stderr
