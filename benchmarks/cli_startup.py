"""How fast the command line answers (issue 33, item 7 and 3): ``tessera --help`` and ``--version`` against
``torchrun --help`` (the launcher it wraps), and a plan the model cannot take (tp=3 with 4 heads) refused by
``tessera train`` before any rank starts. Fresh processes, interleaved, medians.

    python benchmarks/cli_startup.py [--repeats 7]
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parent.parent


def seconds(command: list[str], expect: int) -> float:
    started = time.perf_counter()
    proc = subprocess.run(command, capture_output=True, text=True, cwd=REPO)
    took = time.perf_counter() - started
    assert proc.returncode == expect, (command, proc.returncode, proc.stderr[-500:])
    return took


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=7)
    args = ap.parse_args()
    folder = Path(tempfile.mkdtemp())
    config = yaml.safe_load((REPO / "examples" / "demo.yaml").read_text())
    config["plan"] = {"preset": "ddp", "tp": 3}  # 4 heads: refused before launch
    config["train"]["global_batch_size"] = 12
    config["logging"]["out_dir"] = str(folder / "runs")
    (folder / "tp3.yaml").write_text(yaml.safe_dump(config))
    bin_dir = Path(sys.executable).parent
    cases = {
        "tessera --help": ([str(bin_dir / "tessera"), "--help"], 0),
        "tessera --version": ([str(bin_dir / "tessera"), "--version"], 0),
        "torchrun --help": ([str(bin_dir / "torchrun"), "--help"], 0),
        "tessera train (tp=3, 4 heads): refused": (
            [str(bin_dir / "tessera"), "train", str(folder / "tp3.yaml"), "--nproc", "3"],
            2,
        ),
    }
    times: dict[str, list[float]] = {name: [] for name in cases}
    for _ in range(args.repeats):
        for name, (command, expect) in cases.items():
            times[name].append(seconds(command, expect))
    print(f"| command | median s (of {args.repeats}) | min s |")
    print("|---|---:|---:|")
    for name, took in times.items():
        print(f"| `{name}` | {statistics.median(took):.2f} | {min(took):.2f} |")


if __name__ == "__main__":
    main()
