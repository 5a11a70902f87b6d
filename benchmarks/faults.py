"""Fault scenarios through the real ``tessera train`` (2 ranks): how each ends, how fast, and what is lost.

For each scenario: the exit code, the first words of the one-paragraph error, the time from the
fault to the end of the job, and the training steps lost (done before the fault but not in the
checkpoint the run continues from). The fault time is the time of the last metrics record before
it (``log_every: 1``): the fault fires just after that step. A real full disk is a tmpfs mount
(needs root).

    python benchmarks/faults.py --json docs/faults.json
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

STEPS, EVERY = 8, 2


def config(out_dir: Path, **train: object) -> dict:
    return {
        "model": {"dim": 32, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "ffn_dim": 64},
        "data": {"seq_len": 32, "max_bytes": 60_000},
        "plan": {"preset": "zero", "zero": 2},
        "train": {"steps": STEPS, "global_batch_size": 8, "log_every": 1, "sample_bytes": 0, **train},
        "checkpoint": {"every": EVERY, "keep": 3, "resume": "never"},
        "logging": {"run_name": "f", "out_dir": str(out_dir), "progress": False, "tensorboard": False},
    }


def launch(cfg: dict, tmp: Path, *flags: str, fault: str = "") -> tuple[subprocess.CompletedProcess, float]:
    path = tmp / "config.yaml"
    path.write_text(yaml.safe_dump(cfg))
    env = {k: v for k, v in os.environ.items() if k != "TESSERA_FAULT"} | ({"TESSERA_FAULT": fault} if fault else {})
    cmd = [sys.executable, "-m", "tessera.cli", "train", str(path), "--nproc", "2", *flags]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    return proc, time.time()


def last_record(run: Path) -> dict:
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return [r for r in records if "loss" in r][-1]


def resumed_step(stdout: str) -> int | None:
    for line in stdout.splitlines():
        if line.startswith("resumed from") and " at step " in line:
            return int(line.rsplit(" ", 1)[1])
    return None


def outcome(
    name: str, proc: subprocess.CompletedProcess, end: float, run: Path, lost: int | None, timed: bool = True
) -> dict:
    """``timed``: the fault struck during training (time it from the last step's record)."""
    record = last_record(run) if timed and (run / "metrics.jsonl").is_file() else None
    return {
        "scenario": name,
        "exit": proc.returncode,
        "time_to_error_s": round(end - record["time"], 1) if record and proc.returncode else None,
        "steps_lost": lost,
        "message": (proc.stderr.strip().splitlines() or [""])[-1][:160],
    }


def scenarios(tmp: Path) -> list[dict]:
    out = []
    run = tmp / "runs" / "f"

    def fresh(**train: object) -> dict:
        shutil.rmtree(tmp / "runs", ignore_errors=True)
        return config(tmp / "runs", **train)

    proc, end = launch(fresh(), tmp, "--max-restarts", "1", fault="1:5")
    resumed = resumed_step(proc.stdout)
    out.append(outcome("rank killed before step 5, --max-restarts 1 (resume: never)", proc, end, run, 4 - resumed))
    proc, end = launch(fresh(), tmp, fault="1:5")
    out.append(outcome("rank killed before step 5, no restarts", proc, end, run, None))
    proc, end = launch(fresh(timeout_s=15), tmp, fault="stop:1:5")
    out.append(outcome("rank stopped (SIGSTOP) before step 5, timeout_s 15", proc, end, run, None))
    proc, end = launch(fresh(timeout_s=15), tmp, fault="hang:1:5:120")
    out.append(outcome("rank hangs 120 s before step 5, timeout_s 15", proc, end, run, None))
    proc, end = launch(fresh(), tmp, fault="raise:1:5")
    out.append(outcome("rank raises an unexpected error before step 5", proc, end, run, None))
    proc, end = launch(fresh(), tmp, fault="save:4")
    first = outcome("every rank exits midway through the step-4 save", proc, end, run, None)
    proc, _ = launch(config(tmp / "runs"), tmp, "--resume")
    first["steps_lost"] = 4 - resumed_step(proc.stdout) if proc.returncode == 0 else None
    out.append(first)
    shard = next(sorted((run / "checkpoints").iterdir())[-1].glob("*.distcp"))  # the newest checkpoint's
    shard.write_bytes(shard.read_bytes()[:100])
    proc, end = launch(config(tmp / "runs", steps=STEPS + 2), tmp, "--resume")
    out.append(outcome("a checkpoint shard truncated on disk, then --resume", proc, end, run, None, timed=False))
    proc, end = launch(fresh(), tmp)
    proc, end = launch(config(tmp / "runs"), tmp)
    out.append(outcome("a fresh run (resume: never) in another run's directory", proc, end, run, 0, timed=False))
    out.append(disk_full(tmp))
    return out


def disk_full(tmp: Path) -> dict:
    disk = tmp / "disk"
    disk.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1100k", "tmpfs", str(disk)], capture_output=True)
    if mounted.returncode:
        return {"scenario": "disk full while saving", "exit": None, "message": "not run: tmpfs needs root"}
    try:
        run = disk / "f"
        cfg = config(disk, steps=4)
        proc, end = launch(cfg, tmp)
        result = outcome("disk full while saving the step-4 checkpoint (tmpfs)", proc, end, run, None)
        subprocess.run(["mount", "-o", "remount,size=16m", str(disk)], check=True)
        again, _ = launch(cfg, tmp, "--resume")
        result["steps_lost"] = 4 - resumed_step(again.stdout) if again.returncode == 0 else None
        return result
    finally:
        subprocess.run(["umount", "-l", str(disk)], check=False)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="tessera-faults-") as tmp:
        results = scenarios(Path(tmp))
    print(f"{'scenario':<62} {'exit':>4} {'to error s':>10} {'lost':>4}  message")
    for r in results:
        t = "" if r.get("time_to_error_s") is None else f"{r['time_to_error_s']:.1f}"
        lost = "" if r.get("steps_lost") is None else r["steps_lost"]
        print(f"{r['scenario']:<62} {r['exit']!s:>4} {t:>10} {lost!s:>4}  {r['message'][:90]}")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2) + "\n")
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
