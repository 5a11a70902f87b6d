"""Planned vs uniform, speed-proportional and drop-the-slow DDP on the testbed: CPU quotas 1 : 1 : ½ : ¼, shaped links.

Nothing sleeps: every rank runs `tessera train --testbed` in a CPU cgroup whose quota is its
device's share of ``--cpus`` cores (1.65 by default: 0.6, 0.6, 0.3 and 0.15 of a core, leaving
a third of a core for the harness on 2 cores), and each node of the cluster file is a network
namespace joined to the others by veth pairs shaped with ``tc tbf`` (``--link-mbit``).

1. ``tessera cluster profile --testbed`` measures every rank's device (the model's blocks,
   AdamW's memory speed) and every link. The planner plans from that live profile, not from the
   cluster file's declared speeds (``tessera.planner.live``).
2. Three plans run in turn (interleaved, ``--reps`` times each) through the real launcher:
   *planned* (the planner's best from the live profile, which may leave devices out), *uniform*
   (DDP, equal shares on all four devices), *proportional* (DDP on all four, shares in proportion to
   the live profile's measured speeds: what a user tries first, no search) and *drop slow* (DDP on
   the two fast devices only, at the same quotas). The planner's gain is reported against the
   strongest of the three baselines.
3. Reported: the median step time over steps 3.. of each run (rank 0's ``step_time_s``; the loss
   all-reduce in it waits for the slowest rank), tokens/s, ratios, and what the cost model and the
   simulator predicted for each plan from the live profile.

    sudo python benchmarks/testbed_cluster.py [--reps 3] [--steps 12] [--batch 32] [--json docs/testbed_cluster.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

SEQ, BATCH = 64, 32
MODEL = {"dim": 128, "n_layers": 8, "n_heads": 4, "n_kv_heads": 2, "ffn_dim": 256}
TYPES = {
    "full": {"peak_tflops": {"fp32": 4}, "memory_gib": 8, "bandwidth_gbs": 100},
    "half": {"peak_tflops": {"fp32": 2}, "memory_gib": 8, "bandwidth_gbs": 100},
    "quarter": {"peak_tflops": {"fp32": 1}, "memory_gib": 8, "bandwidth_gbs": 100},
}


def cluster_spec(link_mbit: float, slow_pair_mbit: float = 0.0) -> dict:
    """The testbed's cluster file: every pair of nodes joined at ``link_mbit``, or b and c at
    ``slow_pair_mbit`` when it is given (a ring of all four ranks, and a pipeline's b → c
    transfer, then cross one slow link)."""
    link = {"gbit_s": link_mbit / 1e3, "latency_us": 100}
    links: dict[str, Any] = {"inter_node": link, "inter_region": link}
    if slow_pair_mbit:
        links["between"] = [{"nodes": ["b", "c"], "gbit_s": slow_pair_mbit / 1e3, "latency_us": 100}]
    return {
        "nodes": [
            {"name": "a", "devices": [{"type": "full", "count": 2}]},
            {"name": "b", "devices": [{"type": "half", "count": 1}]},
            {"name": "c", "devices": [{"type": "quarter", "count": 1}]},
        ],
        "device_types": TYPES,
        "links": links,
    }


def config(out_dir: Path, plan: dict, steps: int, name: str, batch: int = BATCH, model: dict = MODEL) -> dict:
    return {
        "model": model,
        "data": {"seq_len": SEQ, "max_bytes": 400_000},
        "plan": plan,
        "train": {"steps": steps, "global_batch_size": batch, "log_every": 1, "sample_bytes": 0, "timeout_s": 300},
        "checkpoint": {"every": 0, "resume": "never"},
        "logging": {"run_name": name, "out_dir": str(out_dir), "progress": False, "tensorboard": False},
    }


def tessera(*args: str) -> str:
    proc = subprocess.run([sys.executable, "-m", "tessera.cli", *args], capture_output=True, text=True)
    if proc.returncode:
        raise SystemExit(f"tessera {' '.join(args)} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return proc.stdout + proc.stderr


def train_records(
    work: Path,
    name: str,
    plan: dict,
    nproc: int,
    cluster_file: Path,
    cpus: float,
    steps: int,
    model: dict = MODEL,
    **train: Any,
) -> list[dict]:
    """The metrics records of one `tessera train --testbed` run (``train``: more ``train:`` fields)."""
    cfg = config(work / "runs", plan, steps, name, model=model)
    cfg["train"].update(train)
    path = work / f"{name}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    tessera("train", str(path), "--nproc", str(nproc), "--testbed", str(cluster_file), "--testbed-cpus", str(cpus),
            "--overwrite")  # fmt: skip
    return [json.loads(line) for line in (work / "runs" / name / "metrics.jsonl").read_text().splitlines()]


def run(
    work: Path,
    name: str,
    plan: dict,
    nproc: int,
    cluster_file: Path,
    cpus: float,
    steps: int,
    batch: int,
    model: dict = MODEL,
) -> float:
    """Median step time (s) over steps 3.. of one `tessera train --testbed` run."""
    records = train_records(work, name, plan, nproc, cluster_file, cpus, steps, model, global_batch_size=batch)
    return statistics.median(r["step_time_s"] for r in records if r["step"] >= 3)


@dataclass
class ProfiledTestbed:
    """A fresh folder with the cluster and model files, and what the live profile measured there."""

    work: Path
    spec: dict
    cluster_file: Path
    model: Any  # the model, on the meta device
    live: Any  # LiveProfile
    cluster: Any  # the measured Cluster
    costs: Any  # the measured ModelCosts


def profile_testbed(
    prefix: str, link_mbit: float, cpus: float, steps: int, slow_pair_mbit: float = 0.0, model: dict = MODEL
) -> ProfiledTestbed:
    """Write the testbed's cluster and ``model``'s files, run `tessera cluster profile --testbed` on them and
    read the measured cluster and costs the planner and the predictors use."""

    from tessera.planner.live.inputs import relative_speeds
    from tessera.planner.live.records import LiveProfile

    work = Path(tempfile.mkdtemp(prefix=prefix))
    spec = cluster_spec(link_mbit, slow_pair_mbit)
    cluster_file = work / "cluster.yaml"
    cluster_file.write_text(yaml.safe_dump(spec))
    model_file = work / "model.yaml"
    model_file.write_text(yaml.safe_dump(config(work / "runs", {"preset": "ddp"}, steps, "profile", model=model)))
    start = time.monotonic()
    tessera("cluster", "profile", str(model_file), "--cluster", str(cluster_file), "--testbed", "--testbed-cpus",
            str(cpus), "--out", str(work / "live.json"))  # fmt: skip
    live = LiveProfile.load(work / "live.json")
    print(f"profiled in {time.monotonic() - start:.0f} s; relative speeds {relative_speeds(live)}; links:")
    for k in live.links:
        print(f"  {k.nodes[0]} <-> {k.nodes[1]}: {k.bandwidth_gbs * 8e3:.1f} Mbit/s, {k.latency_us:.0f} us")
    model, cluster, costs = measured_inputs(model_file, spec, live)
    return ProfiledTestbed(work, spec, cluster_file, model, live, cluster, costs)


def measured_inputs(model_file: Path, spec: dict, live: Any) -> tuple[Any, Any, Any]:
    """What the predictors read from a live profile: the model (meta device), the measured cluster and costs."""
    import torch

    from tessera.cluster.spec import Cluster
    from tessera.config import load_config
    from tessera.models.build import build_model
    from tessera.planner import ModelCosts
    from tessera.planner.live.inputs import measured_cluster, measured_costs

    with torch.device("meta"):
        model = build_model(load_config(str(model_file), []))
    return (
        model,
        measured_cluster(Cluster.from_dict(spec), live),
        measured_costs(live, ModelCosts.from_model(model, SEQ)),
    )


def predictions(plans: dict[str, tuple[Any, Any]], costs: Any, batch: int = BATCH) -> dict[str, dict[str, float]]:
    from tessera.planner.costmodel import estimate
    from tessera.planner.layout import layout_from_plan
    from tessera.planner.simulate import simulate

    out = {}
    for name, (plan, cluster) in plans.items():
        layout = layout_from_plan(plan, cluster, costs, batch)
        out[name] = {"cost_model_s": estimate(layout, costs).step_s, "simulator_s": simulate(layout, costs).step_s}
    return out


def proportional_shares(speeds: list[float], batch: int) -> tuple[int, ...]:
    """``batch`` samples split in proportion to ``speeds`` (largest remainders; at least one each): the
    baseline a user tries first on unlike devices, DDP over all of them with no search."""
    exact = [batch * s / sum(speeds) for s in speeds]
    shares = [max(1, int(x)) for x in exact]
    by_remainder = sorted(range(len(speeds)), key=lambda i: exact[i] - int(exact[i]), reverse=True)
    for i in by_remainder[: batch - sum(shares)]:
        shares[i] += 1
    while sum(shares) > batch:  # (a minimum of one took more than the batch had)
        shares[shares.index(max(shares))] -= 1
    return tuple(shares)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--cpus", type=float, default=1.65)
    ap.add_argument("--link-mbit", type=float, default=1000.0, help="every link between nodes, in Mbit/s")
    ap.add_argument(
        "--batch", type=int, default=BATCH,
        help="global batch (samples of 64 tokens): the larger, the more compute per gradient sync",
    )  # fmt: skip
    ap.add_argument("--json")
    args = ap.parse_args()

    from tessera import DDP, Plan
    from tessera.cluster.spec import Cluster
    from tessera.planner import plan_for
    from tessera.planner.layout import ranks_of

    bed = profile_testbed("testbed-bench-", args.link_mbit, args.cpus, args.steps)
    work, cluster_file, live, measured, costs, model = (
        bed.work, bed.cluster_file, bed.live, bed.cluster, bed.costs, bed.model
    )  # fmt: skip
    best = plan_for(measured, model, args.batch, costs=costs, top=1)[0]
    planned = best.plan
    for note in best.notes:
        print(f"planner: {note}")
    two = Cluster(measured.nodes[:1], measured.device_types, measured.links, measured.pair_links)
    speeds = [device.peak(costs.precision) for _, _, device in measured.devices()]
    proportional = Plan(dp_shares=proportional_shares(speeds, args.batch))
    plans = {
        "planned": (planned, measured),
        "uniform": (DDP(), measured),
        "proportional": (proportional, measured),
        "drop slow": (DDP(), two),
    }
    planned.save(work / "planned-plan.yaml")
    proportional.save(work / "proportional-plan.yaml")
    plan_dicts = {
        "planned": ({"file": str(work / "planned-plan.yaml")}, ranks_of(planned, measured)),
        "uniform": ({"preset": "ddp"}, 4),
        "proportional": ({"file": str(work / "proportional-plan.yaml")}, 4),
        "drop slow": ({"preset": "ddp", "placement": [0, 1]}, 2),
    }
    measured_s: dict[str, list[float]] = {name: [] for name in plans}
    for rep in range(args.reps):
        for name, (plan_dict, nproc) in plan_dicts.items():  # interleaved
            step = run(work, name.replace(" ", "_"), plan_dict, nproc, cluster_file, args.cpus, args.steps, args.batch)
            measured_s[name].append(step)
            print(f"rep {rep} {name:10s} {step:.3f} s/step", flush=True)

    predicted = predictions(plans, costs, args.batch)
    rows = {}
    for name in plans:
        step = statistics.median(measured_s[name])
        rows[name] = {
            "plan": plan_dicts[name][0],
            "ranks": plan_dicts[name][1],
            "measured_step_s": step,
            "runs_s": measured_s[name],
            "tokens_per_s": args.batch * SEQ / step,
            **predicted[name],
        }
    baselines = ("uniform", "proportional", "drop slow")
    strongest = max(baselines, key=lambda name: rows[name]["tokens_per_s"])
    for name, row in rows.items():
        print(
            f"{name:12s} {row['measured_step_s']:.3f} s/step = {row['tokens_per_s']:6.0f} tokens/s "
            f"(x{row['tokens_per_s'] / rows['uniform']['tokens_per_s']:.2f} uniform, "
            f"x{row['tokens_per_s'] / rows['proportional']['tokens_per_s']:.2f} proportional, "
            f"x{row['tokens_per_s'] / rows['drop slow']['tokens_per_s']:.2f} drop slow); predicted: cost model "
            f"{row['cost_model_s']:.3f} s ({row['cost_model_s'] / row['measured_step_s'] - 1:+.0%}), simulator "
            f"{row['simulator_s']:.3f} s ({row['simulator_s'] / row['measured_step_s'] - 1:+.0%})"
        )
    gain = rows["planned"]["tokens_per_s"] / rows[strongest]["tokens_per_s"]
    print(f"planned against the strongest baseline ({strongest}): x{gain:.2f}")
    print(f"planned: {planned.to_dict()}")
    rows["planned"]["against_strongest_baseline"] = {"baseline": strongest, "speedup": gain}
    rows["planned"]["notes"] = list(best.notes)
    if args.json:
        live_json = json.loads(live.to_json())
        out = {"cpus": args.cpus, "link_mbit": args.link_mbit, "global_batch": args.batch, "live_profile": live_json}
        out["rows"] = rows
        Path(args.json).write_text(json.dumps(out, indent=1, default=str) + "\n")
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
