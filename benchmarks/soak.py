"""Soak run: long training with frequent checkpoints must hold memory, open files and disk flat.

Runs ``tessera train`` (the real launcher, 2 ranks) for many steps with a checkpoint every few,
under ZeRO-2 and under a 2-stage 1F1B pipeline, and samples every rank's resident memory (VmRSS)
and open file descriptors from /proc, and the run directory's size, while it trains. Reports the
least-squares slope of each against the step over the second half of the run (after warm-up),
and the disk high-water mark against what ``checkpoint.keep`` allows. Samples taken once the last
step is logged are left out of the slopes: they catch the end of the run (the final checkpoint,
rank 0 importing matplotlib to draw ``loss.png``), not the training loop.

    python benchmarks/soak.py --steps 2000 --every 20 --json docs/soak.json
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

from tessera.launch.jobs import is_rank

LAYOUTS = {
    "zero2": {"preset": "zero", "zero": 2},
    "pp2-1f1b": {"preset": "ddp", "pp": 2, "microbatches": 4, "schedule": "1f1b"},
}


def config(out_dir: Path, steps: int, every: int, keep: int, plan: dict) -> dict:
    return {
        "model": {"dim": 64, "n_layers": 4, "n_heads": 4, "n_kv_heads": 2, "ffn_dim": 128},
        "data": {"seq_len": 64, "max_bytes": 400_000},
        "plan": plan,
        "train": {"steps": steps, "global_batch_size": 8, "log_every": 10, "sample_bytes": 0, "timeout_s": 120},
        "checkpoint": {"every": every, "keep": keep, "resume": "never"},
        "logging": {"run_name": "soak", "out_dir": str(out_dir), "progress": False, "tensorboard": True},
    }


def rank_pids() -> list[int]:
    """Processes running a training rank (python -m tessera.train.run), oldest first."""
    return sorted(int(proc.name) for proc in Path("/proc").iterdir() if proc.name.isdigit() and is_rank(int(proc.name)))


def sample(pid: int) -> dict[str, float] | None:
    """``pid``'s resident memory in MiB (VmRSS, and its anonymous part: heap and tensors, where a
    leak would show; the rest is mapped files such as library code pages touched for the first
    time) and open file descriptors, or None if it is gone."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
        kib = {line.split(":")[0]: int(line.split()[1]) for line in status.splitlines() if line.startswith("Rss")}
        kib["VmRSS"] = next(int(line.split()[1]) for line in status.splitlines() if line.startswith("VmRSS:"))
        fds = len(list(Path(f"/proc/{pid}/fd").iterdir()))
    except (OSError, StopIteration, IndexError, ValueError):
        return None
    return {"rss_mib": kib["VmRSS"] / 1024, "anon_mib": kib.get("RssAnon", 0) / 1024, "fds": fds}


def last_step(metrics: Path) -> int | None:
    try:
        lines = metrics.read_text().splitlines()
    except OSError:
        return None
    for line in reversed(lines):
        try:
            return int(json.loads(line)["step"])
        except (ValueError, KeyError):
            continue
    return None


def disk_bytes(path: Path) -> int:
    total = 0
    for p in path.rglob("*"):
        try:
            total += p.stat().st_size if p.is_file() else 0
        except OSError:  # a checkpoint pruned while we walked
            continue
    return total


def slope(xs: list[float], ys: list[float]) -> float:
    """Least-squares slope of ys against xs."""
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    var = sum((x - mx) ** 2 for x in xs)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / var if var else 0.0


def soak(name: str, plan: dict, steps: int, every: int, keep: int, period_s: float) -> dict:
    with tempfile.TemporaryDirectory(prefix=f"soak-{name}-") as tmp:
        out = Path(tmp)
        cfg_path = out / "soak.yaml"
        cfg_path.write_text(yaml.safe_dump(config(out / "runs", steps, every, keep, plan)))
        run = out / "runs" / "soak"
        start = time.monotonic()
        proc = subprocess.Popen(
            [sys.executable, "-m", "tessera.cli", "train", str(cfg_path), "--nproc", "2"],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        samples: list[dict] = []
        disk_peak = 0
        while proc.poll() is None:
            time.sleep(period_s)
            step = last_step(run / "metrics.jsonl")
            disk_peak = max(disk_peak, disk_bytes(run / "checkpoints") if run.exists() else 0)
            for rank, pid in enumerate(rank_pids()):
                got = sample(pid)
                if step is not None and got is not None:
                    samples.append({"rank": rank, "step": step, **got})
        _, err = proc.communicate()
        if proc.returncode:
            raise SystemExit(f"{name}: tessera train failed ({proc.returncode}): {err[-2000:]}")
        ckpt_bytes = [disk_bytes(p) for p in (run / "checkpoints").iterdir()]
        result = {
            "layout": name,
            "steps": steps,
            "checkpoint_every": every,
            "keep": keep,
            "wall_s": time.monotonic() - start,
            "checkpoints_left": len(ckpt_bytes),
            "checkpoint_mib": max(ckpt_bytes) / 2**20,
            "disk_peak_mib": disk_peak / 2**20,
            "disk_bound_mib": (keep + 1) * max(ckpt_bytes) / 2**20,  # keep complete + one being written
            "ranks": [],
        }
        for rank in sorted({s["rank"] for s in samples}):
            mine = [s for s in samples if s["rank"] == rank]
            # Training only: once the last step is logged, rank 0 saves, plots and closes (not a leak).
            late = [s for s in mine if steps // 2 <= s["step"] < steps]
            steps_late = [s["step"] for s in late]
            result["ranks"].append(
                {
                    "rank": rank,
                    "samples": len(mine),
                    "rss_first_mib": mine[0]["rss_mib"],
                    "rss_last_mib": mine[-1]["rss_mib"],
                    "anon_last_training_mib": late[-1]["anon_mib"],
                    "rss_max_mib": max(s["rss_mib"] for s in mine),
                    "rss_slope_mib_per_1000_steps": 1000 * slope(steps_late, [s["rss_mib"] for s in late]),
                    "anon_first_mib": mine[0]["anon_mib"],
                    "anon_last_mib": mine[-1]["anon_mib"],
                    "anon_slope_mib_per_1000_steps": 1000 * slope(steps_late, [s["anon_mib"] for s in late]),
                    "fds_first": mine[0]["fds"],
                    "fds_last": mine[-1]["fds"],
                    "fds_max": max(s["fds"] for s in mine),
                    "fds_slope_per_1000_steps": 1000 * slope(steps_late, [s["fds"] for s in late]),
                }
            )
        return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--every", type=int, default=20)
    ap.add_argument("--keep", type=int, default=2)
    ap.add_argument("--period", type=float, default=1.0, help="seconds between samples")
    ap.add_argument("--layouts", nargs="*", default=list(LAYOUTS))
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args()
    results = [soak(n, LAYOUTS[n], args.steps, args.every, args.keep, args.period) for n in args.layouts]
    print(
        f"{'layout':>9} {'rank':>4} {'RSS first→last (max) MiB':>26} {'RSS slope MiB/1k steps':>23} "
        f"{'anon first→last (training)':>26} {'anon slope':>10} "
        f"{'fds first→last':>15} {'fd slope/1k':>11} {'disk peak/bound MiB':>20} {'wall s':>7}"
    )
    for r in results:
        for k in r["ranks"]:
            print(
                f"{r['layout']:>9} {k['rank']:>4} "
                f"{k['rss_first_mib']:>10.1f}→{k['rss_last_mib']:.1f} ({k['rss_max_mib']:.1f}) "
                f"{k['rss_slope_mib_per_1000_steps']:>23.2f} "
                f"{k['anon_first_mib']:>13.1f}→{k['anon_last_training_mib']:<12.1f} "
                f"{k['anon_slope_mib_per_1000_steps']:>10.2f} "
                f"{k['fds_first']:>8}→{k['fds_last']:<6} "
                f"{k['fds_slope_per_1000_steps']:>11.2f} "
                f"{r['disk_peak_mib']:>10.2f}/{r['disk_bound_mib']:<9.2f} {r['wall_s']:>7.0f}"
            )
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2) + "\n")
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
