"""Faults, end to end through ``tessera train``: a killed rank is restarted by torchrun and the run ends
bit-identical to an uninterrupted one (also with ``resume: never``: a restart continues its own run); a
hung rank makes the others fail with a clear message; a stopped rank ends the job soon after the
collective timeout, in the failing rank's own words; a full disk while saving is a clear error that
keeps the last checkpoint."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
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
    config = tiny_config(faulty, steps=8, every=2, plan=plan)
    config["checkpoint"]["resume"] = "never"  # the demo's setting: a restart must still continue, not start over
    proc = _launch(config, tmp_path, "faulty", "--max-restarts", "2", fault="1:5")
    # rank 1 dies just before step 5, after the step-4 checkpoint
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


def _one_paragraph(stderr: str) -> str:
    assert stderr.startswith("tessera: error:") and "Traceback" not in stderr, stderr
    assert stderr.strip().count("\n") == 0, stderr
    return stderr


def test_stopped_rank_ends_the_job_in_the_failing_ranks_words(tmp_path: Path) -> None:
    """Rank 1 freezes (SIGSTOP) before step 3: rank 0's collective times out after train.timeout_s, it
    reports, and the launcher kills the frozen rank instead of waiting torchrun's fixed 30 s."""
    config = tiny_config(tmp_path, steps=6, every=0, plan={"preset": "ddp"})
    config["train"]["timeout_s"] = 4
    start = time.monotonic()
    proc = _launch(config, tmp_path, "stopped", fault="stop:1:3")
    elapsed = time.monotonic() - start
    message = _one_paragraph(proc.stderr)
    assert proc.returncode == 3, message
    assert "rank 0, step 3: a collective of step 3" in message and "rank 1 (stopped)" in message, message
    log = Path(message.rsplit("Full tracebacks: ", 1)[1].strip())
    assert log.parent == tmp_path / "t" / "logs" and "CollectiveTimeout" in log.read_text()
    left = subprocess.run(["pgrep", "-f", str(tmp_path / "stopped.yaml")], capture_output=True, text=True)
    assert left.stdout == "", f"ranks left running: {left.stdout}"
    print(f"stopped rank: job ended {elapsed:.1f} s after launch (timeout_s=4)")


def _mount_tmpfs(path: Path, size: str) -> None:
    path.mkdir(parents=True, exist_ok=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], check=True)


def test_disk_full_while_saving_keeps_the_last_checkpoint(tmp_path: Path) -> None:
    """A real full disk: a tmpfs with room for one checkpoint (~0.7 MB) but not two."""
    disk = tmp_path / "disk"
    _mount_tmpfs(disk, "1100k")
    try:
        config = tiny_config(disk, steps=4, every=2, plan={"preset": "zero", "zero": 2})
        proc = _launch(config, tmp_path, "full")
        message = _one_paragraph(proc.stderr)
        assert proc.returncode == 4, message
        assert re.search(r"rank [01], saving the step-4 checkpoint: the disk is full", message), message
        assert "step_00000002', is intact" in message, message
        checkpoints = disk / "t" / "checkpoints"
        assert sorted(p.name for p in checkpoints.iterdir()) == ["step_00000002"], "partial save left behind"
        assert (checkpoints / "step_00000002" / "meta.json").is_file()
        # Resuming once space is freed is measured by benchmarks/faults.py (a second launch costs ~15 s here).
    finally:
        subprocess.run(["umount", "-l", str(disk)], check=False)
