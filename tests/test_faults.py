"""Train-issue acceptance 4 and the no-hang rule: a killed rank is restarted by torchrun and the run
ends bit-identical to an uninterrupted one; a hung rank makes the others fail with a clear message."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from test_checkpoint import checkpoint_tensors, ckpt, tiny_config, train_worker

from tessera.testing import run_ranks


def _launch(config: dict, tmp: Path, name: str, *flags: str, fault: str | None = None) -> subprocess.CompletedProcess:
    path = tmp / f"{name}.yaml"
    path.write_text(yaml.safe_dump(config))
    env = {k: v for k, v in os.environ.items() if k != "TESSERA_FAULT"}
    if fault:
        env["TESSERA_FAULT"] = fault
    cmd = [sys.executable, "-m", "tessera.cli", "train", str(path), "--nproc", "2", *flags]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)


def test_killed_rank_restarts_and_matches_uninterrupted_run(tmp_path: Path) -> None:
    plan = {"preset": "zero", "zero": 3}
    faulty, clean = tmp_path / "faulty", tmp_path / "clean"
    proc = _launch(
        tiny_config(faulty, steps=8, every=2, plan=plan), tmp_path, "faulty", "--max-restarts", "2", fault="1:5"
    )  # rank 1 dies just before step 5, after the step-4 checkpoint
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "resumed from" in proc.stdout and "step_00000004 at step 4" in proc.stdout, proc.stdout
    proc = _launch(tiny_config(clean, steps=8, every=2, plan=plan), tmp_path, "clean")
    assert proc.returncode == 0, proc.stderr
    a, b = checkpoint_tensors(ckpt(faulty, 8), tmp_path), checkpoint_tensors(ckpt(clean, 8), tmp_path)
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), f"{k} differs between the restarted and the uninterrupted run"


def test_hung_rank_fails_the_others_with_group_and_step(tmp_path: Path) -> None:
    config = tiny_config(tmp_path, steps=6, every=0, plan={"preset": "ddp"})
    config["train"]["timeout_s"] = 4
    with pytest.raises(RuntimeError) as info:
        run_ranks(train_worker, 2, config, "hang:1:3:15", timeout_s=60, collective_timeout_s=4)
    message = str(info.value)
    assert "CollectiveTimeout: a collective of step 3" in message and "group 'dp'" in message, message
