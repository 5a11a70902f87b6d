"""How well the cost model and the simulator predict real runs: 12 layouts measured on the testbed.

The testbed is the one of ``benchmarks/testbed_cluster.py``: four ranks in CPU cgroups with
quotas 1 : 1 : ½ : ¼ (nodes a, a, b, c), each node a network namespace, links between nodes
shaped with ``tc tbf`` (``--link-mbit``, 200 Mbit/s by default so that communication is a real
share of the step; ``--slow-link-mbit``, 50 by default, between b and c, which a ring of all four
ranks and a pipeline's b → c transfer cross). Nothing is paced by the planner's numbers.

1. ``tessera cluster profile --testbed`` measures every device on the model's own blocks and
   every link; both predictors read that live profile and nothing else they share.
2. Twelve layouts (DDP, uneven shares, ZeRO-1/2/3, pipelines 1f1b and gpipe with even and
   uneven stages, pp × dp, tensor parallel, slow-link data parallel) run through the real
   launcher, interleaved, ``--reps`` times each. Measured: rank 0's median ``step_time_s`` over
   steps 3 .. steps − 1, and, at the last step, every rank's peak tensor bytes
   (``train.measure_memory_at``: the profiler's allocation record on CPU, the allocator's peak on
   a GPU).
3. Reported per layout: measured step, the cost model's and the simulator's predictions and their
   errors, each separately; predicted and measured peak bytes per rank. Summary: median and worst
   absolute error of each predictor, and the share of layouts each ranks correctly against the
   others (pairwise order agreement).

    sudo python benchmarks/testbed_predictions.py [--reps 2] [--steps 8] [--json docs/testbed_predictions.json]

``--repredict FILE`` runs nothing: it predicts a stored run's layouts again from the live profile
stored with it, with today's predictors, and rewrites the predictions and the summary (the
measurements are left as they are).
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))
from testbed_cluster import (  # noqa: E402
    BATCH,
    MODEL,
    cluster_spec,
    config,
    measured_inputs,
    profile_testbed,
    train_records,
)

# name -> (plan section, ranks). Ranks take cluster devices in order (a:0, a:1, b:0, c:0) unless placed.
LAYOUTS: dict[str, tuple[dict, int]] = {
    "ddp x4": ({"preset": "ddp"}, 4),
    "ddp x2 (a)": ({"preset": "ddp", "placement": [0, 1]}, 2),
    "ddp x4 shares 12:12:6:2": ({"preset": "ddp", "dp_shares": [12, 12, 6, 2]}, 4),
    "ddp a+b shares 20:12": ({"preset": "ddp", "placement": [0, 2], "dp_shares": [20, 12]}, 2),
    "zero1 x4": ({"preset": "zero", "zero": 1}, 4),
    "zero2 x2 (a)": ({"preset": "zero", "zero": 2, "placement": [0, 1]}, 2),
    "zero3 x4": ({"preset": "zero", "zero": 3}, 4),
    "pp2 1f1b m4 (a)": ({"preset": "ddp", "pp": 2, "microbatches": 4, "placement": [0, 1]}, 2),
    "pp2 x dp2 1f1b m4": ({"preset": "ddp", "pp": 2, "microbatches": 4}, 4),
    "pp4 gpipe m8": ({"preset": "ddp", "pp": 4, "microbatches": 8, "schedule": "gpipe"}, 4),
    "pp2 a+b stages 6:2 m4": (
        {"preset": "ddp", "pp": 2, "microbatches": 4, "stages": [[0, 6], [6, 8]], "placement": [0, 2]},
        2,
    ),
    "tp2 (a)": ({"preset": "ddp", "tp": 2, "placement": [0, 1]}, 2),
}


def run(
    work: Path, name: str, plan: dict, nproc: int, cluster_file: Path, cpus: float, steps: int, model: dict = MODEL
) -> dict:
    """One `tessera train --testbed` run: median step time (steps 3 .. steps − 1) and peak bytes per rank."""
    slug = "".join(c if c.isalnum() else "_" for c in name)
    records = train_records(work, slug, plan, nproc, cluster_file, cpus, steps, model, measure_memory_at=steps)
    step = statistics.median(r["step_time_s"] for r in records if 3 <= r["step"] < steps)
    return {"step_s": step, "peak_bytes": records[-1]["peak_tensor_bytes_per_rank"]}


def predict(plan: Any, cluster: Any, costs: Any) -> dict:
    """Both predictors' step time, and the cost model's peak bytes per rank (in rank order)."""
    from tessera.plan import RankCoords
    from tessera.planner.costmodel import device_memory, estimate
    from tessera.planner.layout import layout_from_plan, ranks_of
    from tessera.planner.simulate import simulate

    layout = layout_from_plan(plan, cluster, costs, BATCH)
    world = ranks_of(plan, cluster)
    resolved = plan.resolve(world)
    memory = [0.0] * world
    # a grid's replicas, or (Plan.replicas) each replica's own one-replica layout
    parts = [(layout, r) for r in range(len(layout.replicas))] if hasattr(layout, "replicas") else [
        (part, i) for i, part in enumerate(layout.parts)
    ]  # fmt: skip
    for part, r in parts:
        spec = part.replicas[r] if part is layout else part.replicas[0]
        for s in range(part.pp):
            total = sum(device_memory(part, costs, spec, s))
            for t in range(part.tp):
                memory[resolved.rank_at(RankCoords(pp=s, dp=r, tp=t))] = total
    return {
        "cost_model_s": estimate(layout, costs).step_s,
        "simulator_s": simulate(layout, costs).step_s,
        "predicted_peak_bytes": memory,
    }


def order_agreement(rows: dict[str, dict], key: str) -> float:
    """Share of layout pairs that ``key`` orders as the measurement does."""
    pairs = list(itertools.combinations(rows.values(), 2))
    same = sum((a[key] < b[key]) == (a["measured_step_s"] < b["measured_step_s"]) for a, b in pairs)
    return same / len(pairs)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--cpus", type=float, default=1.65)
    ap.add_argument("--link-mbit", type=float, default=200.0)
    ap.add_argument("--slow-link-mbit", type=float, default=50.0, help="the link between nodes b and c")
    ap.add_argument("--only", nargs="*", help="run only these layouts (names as in LAYOUTS)")
    ap.add_argument("--json")
    ap.add_argument("--repredict", help="a stored run's JSON: predict its layouts again from its own profile")
    args = ap.parse_args()
    if args.repredict:
        repredict(Path(args.repredict))
        return

    layouts = {k: v for k, v in LAYOUTS.items() if not args.only or k in args.only}
    bed = profile_testbed("testbed-predictions-", args.link_mbit, args.cpus, args.steps, args.slow_link_mbit)
    work, cluster_file, live, cluster, costs = bed.work, bed.cluster_file, bed.live, bed.cluster, bed.costs

    measured: dict[str, list[dict]] = {name: [] for name in layouts}
    for rep in range(args.reps):
        for name, (plan, nproc) in layouts.items():  # interleaved
            result = run(work, name, plan, nproc, cluster_file, args.cpus, args.steps)
            measured[name].append(result)
            print(f"rep {rep} {name:26s} {result['step_s']:.3f} s/step", flush=True)

    rows = {name: measured_row(plan_dict, nproc, measured[name]) for name, (plan_dict, nproc) in layouts.items()}
    summary = predict_rows(rows, cluster, costs)
    if args.json:
        out = {
            "cpus": args.cpus,
            "link_mbit": args.link_mbit,
            "slow_link_mbit": args.slow_link_mbit,
            "steps": args.steps,
            "reps": args.reps,
            "live_profile": json.loads(live.to_json()),
            "rows": rows,
            "summary": summary,
        }
        Path(args.json).write_text(json.dumps(out, indent=1, default=str) + "\n")
        print(f"wrote {args.json}")


def measured_row(plan: dict, nproc: int, runs: list[dict]) -> dict[str, Any]:
    """One layout's row from its runs (each :func:`run`'s result): the median step, every run's, and each
    rank's largest peak."""
    return {
        "plan": plan,
        "ranks": nproc,
        "measured_step_s": statistics.median(m["step_s"] for m in runs),
        "runs_s": [m["step_s"] for m in runs],
        "measured_peak_bytes": [max(m["peak_bytes"][i] for m in runs) for i in range(nproc)],
    }


def error_summary(rows: list[dict]) -> dict[str, dict[str, float]]:
    """Median and worst absolute error of each predictor over ``rows`` (after :func:`predict_rows` filled
    them), and of the memory predictions over every rank."""
    summary = {}
    for key in ("cost_model", "simulator"):
        errors = [abs(r[f"{key}_error"]) for r in rows]
        summary[key] = {"median_abs_error": statistics.median(errors), "worst_abs_error": max(errors)}
    memory_errors = [abs(e) for r in rows for e in r["memory_error"]]
    summary["memory"] = {
        "median_abs_error": statistics.median(memory_errors),
        "worst_abs_error": max(memory_errors),
        "within_15_percent": sum(e <= 0.15 for e in memory_errors) / len(memory_errors),
    }
    return summary


def predict_rows(rows: dict[str, dict], cluster: Any, costs: Any) -> dict:
    """Both predictors' figures and errors into every row (in place); returns the summary."""
    from tessera.config import PlanConfig, plan_from_config

    for name, row in rows.items():
        row.update(predict(plan_from_config(PlanConfig(**row["plan"])), cluster, costs))
        for key in ("cost_model", "simulator"):
            row[f"{key}_error"] = row[f"{key}_s"] / row["measured_step_s"] - 1
        row["memory_error"] = [p / m - 1 for p, m in zip(row["predicted_peak_bytes"], row["measured_peak_bytes"])]
        print(
            f"{name:26s} measured {row['measured_step_s']:.3f} s  cost model {row['cost_model_s']:.3f} "
            f"({row['cost_model_error']:+.0%})  simulator {row['simulator_s']:.3f} ({row['simulator_error']:+.0%})  "
            f"memory MiB predicted/measured "
            + " ".join(
                f"{p / 2**20:.0f}/{m / 2**20:.0f}"
                for p, m in zip(row["predicted_peak_bytes"], row["measured_peak_bytes"])
            )
        )  # fmt: skip
    summary = error_summary(list(rows.values()))
    for key in ("cost_model", "simulator"):
        summary[key]["order_agreement"] = order_agreement(rows, f"{key}_s")
    print("summary", json.dumps(summary, indent=1))
    return summary


def stored_inputs(live: dict, steps: int, link_mbit: float, slow_link_mbit: float, model: dict = MODEL) -> tuple:
    """(cluster, costs) the predictors read, rebuilt from a stored run's live profile and bed."""
    import tempfile

    import yaml

    from tessera.planner.live.records import LiveProfile

    work = Path(tempfile.mkdtemp(prefix="testbed-repredict-"))
    (work / "live.json").write_text(json.dumps(live))
    (work / "model.yaml").write_text(yaml.safe_dump(config(work, {"preset": "ddp"}, steps, "repredict", model=model)))
    spec = cluster_spec(link_mbit, slow_link_mbit)
    _, cluster, costs = measured_inputs(work / "model.yaml", spec, LiveProfile.load(work / "live.json"))
    return cluster, costs


def repredict(path: Path) -> None:
    """Predict a stored run's layouts again from the live profile stored with it; rewrite ``path``."""
    stored = json.loads(path.read_text())
    bed = (stored["live_profile"], stored["steps"], stored["link_mbit"], stored["slow_link_mbit"])
    cluster, costs = stored_inputs(*bed)
    stored["summary"] = predict_rows(stored["rows"], cluster, costs)
    path.write_text(json.dumps(stored, indent=1, default=str) + "\n")
    print(f"rewrote {path}")


if __name__ == "__main__":
    main()
