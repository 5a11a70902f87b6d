"""The cost model and the simulator scored out of sample: layouts, models and links never used to tune them.

``benchmarks/prediction_sets.yaml`` lists what ever tuned the predictors (calibration) and the held-out
beds scored here. Each bed is the testbed of ``benchmarks/testbed_cluster.py`` (nodes a: 2 × full,
b: half, c: quarter at ``--cpus``) with its own model and link rates. For each bed:

1. ``tessera cluster profile --testbed`` measures it; both predictors read that live profile only.
2. Its layouts run through the real launcher, interleaved, ``--reps`` times; measured as in
   ``testbed_predictions.py`` (rank 0's median step over steps 3 .. steps − 1; every rank's peak tensor
   bytes at the last step).
3. The predictors, as they were at the file's ``frozen_at`` commit (refused if their files changed since),
   predict each layout; errors per layout, and the median and worst over all held-out layouts.

On the stability bed the profile is taken ``--profiles`` times: the planner plans from each, and each pick
is priced under every other profile, against that profile's own spread (:attr:`LiveProfile.spread`).

    sudo python benchmarks/held_out_predictions.py [--reps 2] [--steps 8] [--profiles 3] \\
        [--json docs/held_out_predictions_3.json]

``--repredict FILE`` runs nothing: it prints a stored run's layouts predicted by the predictors as they are
in this checkout, each bed from its stored profile (the file keeps the scored predictions).

Each run also records the host's speed beside it (:func:`host_seconds`), and each row a second score
against its steps scaled to the host's speed during the profile (``host_normalised``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import yaml

sys.path.insert(0, str(Path(__file__).parent))
from testbed_cluster import BATCH, profile_testbed  # noqa: E402
from testbed_predictions import error_summary, measured_row, predict_rows, run, stored_inputs  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
SETS = Path(__file__).with_name("prediction_sets.yaml")


def check_frozen(sets: dict) -> str:
    """The frozen commit, after checking that no predictor file differs from it (here, uncommitted or not)."""
    frozen = sets["frozen_at"]
    changed = subprocess.run(
        ["git", "diff", "--name-only", frozen, "--", *sets["predictors"]], cwd=ROOT, capture_output=True, text=True
    )
    if changed.returncode:
        raise SystemExit(f"cannot compare with frozen_at {frozen}: {changed.stderr.strip()}")
    if changed.stdout.strip():
        raise SystemExit(
            f"the predictors changed since frozen_at {frozen} ({changed.stdout.split()}): held-out cases score "
            "the frozen predictors only. Move the cases that led to the change to calibration, freeze again, "
            "and draw new held-out cases (benchmarks/prediction_sets.yaml)."
        )
    return frozen


def host_seconds() -> float:
    """Seconds of a fixed single-threaded workload here, the median of five: the host's speed now. This shared
    machine drifts by tens of percent over minutes, and each layout runs minutes after the profile, so each
    run records the host's speed beside it (``host_ratio``: this over its value around the profile)."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(0)
    x, w = torch.randn(64, 192, generator=gen), torch.randn(192, 192, generator=gen) / 14
    times = []
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(2000):  # matmuls and small element-wise ops, as a training step mixes them
            x = torch.tanh(x @ w) + 0.01
        times.append(time.perf_counter() - start)
    torch.set_num_threads(threads)
    return statistics.median(times)


def normalised(rows: list[dict]) -> dict:
    """Each row's steps divided by the host's speed ratio of their run (the host as fast as during the
    profile), the predictors' errors against that, and their median and worst."""
    for row in rows:
        row["normalised_step_s"] = statistics.median(t / r for t, r in zip(row["runs_s"], row["host_ratios"]))
        for key in ("cost_model", "simulator"):
            row[f"{key}_error_normalised"] = row[f"{key}_s"] / row["normalised_step_s"] - 1
    out = {}
    for key in ("cost_model", "simulator"):
        errors = [abs(row[f"{key}_error_normalised"]) for row in rows]
        out[key] = {"median_abs_error": statistics.median(errors), "worst_abs_error": max(errors)}
    return out


def with_paths(model: dict) -> dict:
    """A bed's model with an ``hf_config`` path relative to the repository made absolute (runs start elsewhere)."""
    path = model.get("hf_config")
    return {**model, "hf_config": str(ROOT / path)} if path and not Path(path).is_absolute() else model


def stability(bed: dict, name: str, first: Any, profiles: int, cpus: float, steps: int) -> dict:
    """``profiles`` live profiles of one bed (``first`` is one): each one's pick and spread, and each pick
    priced under every profile against that profile's best."""
    from tessera.planner import plan_for
    from tessera.planner.costmodel import estimate
    from tessera.planner.layout import layout_from_plan

    beds = [first] + [
        profile_testbed(f"held-out-{name}-again-", bed["link_mbit"], cpus, steps, bed["slow_link_mbit"], bed["model"])
        for _ in range(profiles - 1)
    ]
    picks = []
    for tb in beds:
        best = plan_for(tb.cluster, tb.model, BATCH, precision="fp32", top=1, costs=tb.costs, pin_precision=True)[0]
        picks.append(best)
        print(f"profile spread {tb.live.spread:.1%}: pick {best.placement} at {best.estimate.step_s:.3f} s", flush=True)
    cross = []  # cross[i][j]: pick i's predicted step under profile j, over profile j's own pick's
    for pick in picks:
        row = []
        for tb, own in zip(beds, picks):
            step = estimate(layout_from_plan(pick.plan, tb.cluster, tb.costs, BATCH), tb.costs).step_s
            row.append(step / own.estimate.step_s - 1)
        cross.append(row)
    spreads = [tb.live.spread for tb in beds]
    same = all(p.plan == picks[0].plan for p in picks)
    within = all(cross[i][j] <= spreads[j] + 1e-12 for i in range(len(picks)) for j in range(len(picks)))
    return {
        "bed": name,
        "spreads": spreads,
        "picks": [{"placement": p.placement, "step_s": p.estimate.step_s, "plan": p.plan.to_dict()} for p in picks],
        "cross_excess": cross,
        "same_pick": same,
        "within_spread": within,
    }


def pooled(beds: dict[str, dict]) -> dict:
    """Median and worst absolute error of each predictor over every held-out layout, and memory."""
    rows = [row for bed in beds.values() for row in bed["rows"].values()]
    return {**error_summary(rows), "host_normalised": normalised(rows), "layouts": len(rows)}


def repredict(path: Path) -> None:
    """Predict a stored held-out run's layouts again, each bed from its own stored profile, with the predictors
    as they are here (e.g. at a later or earlier commit); prints, and leaves the scored file as it was."""
    stored = json.loads(path.read_text())
    for name, bed in stored["beds"].items():
        cluster, costs = stored_inputs(
            bed["live_profile"], stored["steps"], bed["link_mbit"], bed["slow_link_mbit"], with_paths(bed["model"])
        )
        print(name)
        rows = json.loads(json.dumps(bed["rows"]))  # a copy: the stored predictions stay the scored ones
        predict_rows(rows, cluster, costs)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--cpus", type=float, default=1.65)
    ap.add_argument("--profiles", type=int, default=3, help="live profiles of the stability bed (1: none again)")
    ap.add_argument("--only", nargs="*", help="run only these beds")
    ap.add_argument("--json")
    ap.add_argument("--repredict", help="a stored run's JSON: predict its layouts again here, run nothing")
    args = ap.parse_args()
    if args.repredict:
        repredict(Path(args.repredict))
        return
    sets = yaml.safe_load(SETS.read_text())
    frozen = check_frozen(sets)
    held = sets["held_out"]
    out: dict[str, Any] = {"frozen_at": frozen, "cpus": args.cpus, "steps": args.steps, "reps": args.reps, "beds": {}}
    for name, bed in held["beds"].items():
        if args.only and name not in args.only:
            continue
        bed = {**bed, "model": with_paths(bed["model"])}
        before = host_seconds()
        tb = profile_testbed(
            f"held-out-{name}-", bed["link_mbit"], args.cpus, args.steps, bed["slow_link_mbit"], bed["model"]
        )
        at_profile = (before + host_seconds()) / 2
        layouts = {k: (v["plan"], v["ranks"]) for k, v in bed["layouts"].items()}
        measured: dict[str, list[dict]] = {k: [] for k in layouts}
        failed: dict[str, str] = {}  # a layout that does not run is reported, not scored
        for rep in range(args.reps):
            for layout, (plan, nproc) in layouts.items():  # interleaved
                if layout in failed:
                    continue
                try:
                    before = host_seconds()
                    result = run(
                        tb.work, layout, plan, nproc, tb.cluster_file, args.cpus, args.steps, model=bed["model"]
                    )
                    result["host_ratio"] = (before + host_seconds()) / 2 / at_profile
                except SystemExit as exc:
                    failed[layout] = str(exc)[-2000:]
                    print(f"{name} rep {rep} {layout:34s} FAILED: {failed[layout]}", flush=True)
                    continue
                measured[layout].append(result)
                print(
                    f"{name} rep {rep} {layout:34s} {result['step_s']:.3f} s/step, host {result['host_ratio']:.2f}x "
                    "its time at the profile",
                    flush=True,
                )
        rows = {k: measured_row(plan, nproc, measured[k]) for k, (plan, nproc) in layouts.items() if k not in failed}
        for k, row in rows.items():
            row["host_ratios"] = [m["host_ratio"] for m in measured[k]]
        summary = {**predict_rows(rows, tb.cluster, tb.costs), "host_normalised": normalised(list(rows.values()))}
        out["beds"][name] = {
            **{k: bed[k] for k in ("model", "link_mbit", "slow_link_mbit")},
            "host_seconds_at_profile": at_profile,
            "live_profile": json.loads(tb.live.to_json()),
            "rows": rows,
            "failed": failed,
            "summary": summary,
        }
        if name == held.get("stability_bed") and args.profiles > 1:
            out["stability"] = stability(bed, name, tb, args.profiles, args.cpus, args.steps)
            print("stability", json.dumps({k: v for k, v in out["stability"].items() if k != "picks"}), flush=True)
    out["summary"] = pooled(out["beds"])
    print("held-out summary", json.dumps(out["summary"], indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1, default=str) + "\n")
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
