"""`make demo`'s job runs end to end through torchrun (shortened) and the loss falls."""

from __future__ import annotations

import re
import subprocess
import sys


def test_demo_runs_under_torchrun_and_learns() -> None:
    cmd = [sys.executable, "-m", "tessera.cli", "demo", "--nproc", "2", "--steps", "30", "--seq-len", "64"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    m = re.search(r"loss ([\d.]+) -> ([\d.]+) in 30 steps", proc.stdout)
    assert m, proc.stdout + proc.stderr
    first, last = map(float, m.groups())
    assert last < first - 1.0, f"the demo did not learn: {first} -> {last}"


def test_plan_check_cli(tmp_path) -> None:
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
