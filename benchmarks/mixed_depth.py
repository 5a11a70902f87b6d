"""Replicas of different depth (the Zorse shape) on an emulated 3-device cluster where memory binds.

One "big" device (speed 1, ample memory) and two "small" ones (speed ¼, too little memory for
the whole model, enough for half of it), played by three local CPU ranks
(``tessera.cluster.emulate``; EMULATED: the numbers are about scheduling work over devices of
different speed and memory, not about any real GPU). Same model, data, calibration and timing
rules as ``benchmarks/emulated_cluster.py``. Three plans, interleaved, ``--reps`` times each:

- planned: the planner's best plan over every layout it knows (grid and replicas of different depth);
- mixed: its best plan with replicas of different depth (the big device alone, the small pair as
  a two-stage pipeline), and "mixed m>=2" the best such plan whose pipeline gets at least two
  micro-batches (one micro-batch count serves every replica, and the big one wants one);
- drop small: the big device alone.

Reported: measured median step time and tokens/s, the planner's prediction for each, ratios —
whether the planner's ranking holds when the plans run.

    python benchmarks/mixed_depth.py [--reps 3] [--steps 8] [--time-scale 8] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
from pathlib import Path
from typing import Any

import torch
import yaml
from emulated_cluster import BATCH, SEQ, build_model, calibrate, plan_summary, train_worker

SMALL_GIB = 0.018  # the reference Llama's fp32 AdamW state is ~20 MB: half of it fits, all of it does not
THREE = {
    "nodes": [
        {"name": "a", "devices": [{"type": "big", "count": 1}]},
        {"name": "b", "devices": [{"type": "small", "count": 2}]},
    ],
    "device_types": {
        "big": {"peak_tflops": {"fp32": 4}, "memory_gib": 8, "bandwidth_gbs": 100},
        "small": {"peak_tflops": {"fp32": 1}, "memory_gib": SMALL_GIB, "bandwidth_gbs": 100},
    },
    "links": {
        "intra_node": {"bandwidth_gbs": 1, "latency_us": 200},
        "inter_node": {"bandwidth_gbs": 1, "latency_us": 200},
    },
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--time-scale", type=float, default=8.0)
    ap.add_argument("--json")
    args = ap.parse_args()

    from tessera import DDP
    from tessera.cluster import Cluster
    from tessera.planner.costmodel import estimate
    from tessera.planner.costs import ModelCosts
    from tessera.planner.layout import layout_from_plan
    from tessera.planner.profile import profile_model
    from tessera.planner.search import search
    from tessera.testing import run_ranks

    torch.set_num_threads(1)
    profile = profile_model(build_model(), batch_sizes=(1, 2, 4, 8, 16), seq_len=SEQ, repeats=7)
    costs = ModelCosts.from_profile(profile, peak_tflops=4.0 * args.time_scale, hidden=128)
    spec = calibrate(THREE, costs.stage_params(0, costs.n_layers))
    alone_spec = {**spec, "nodes": [spec["nodes"][0]]}
    three, alone = Cluster.from_dict(spec), Cluster.from_dict(alone_spec)
    found = search(three, costs, BATCH, top=400)
    mixed = [c for c in found if c.plan.replicas is not None and len({r.depth for r in c.plan.replicas}) > 1]
    plans = {
        "planned": (found[0].plan, three, spec),
        "mixed": (mixed[0].plan, three, spec),
        "mixed m>=2": (next(c for c in mixed if c.plan.pipeline.microbatches >= 2).plan, three, spec),
        "drop small": (DDP(), alone, alone_spec),
    }
    for name, (plan, _, _) in plans.items():
        print(f"{name:10s} {plan.to_dict()}")
    tmp = Path(tempfile.mkdtemp())
    measured: dict[str, list[float]] = {name: [] for name in plans}
    notes: dict[str, Any] = {}
    os.environ["TESSERA_EMULATE_SCALE"] = str(args.time_scale)
    # The cluster's links are this machine's own, measured above: the real transfers already take that
    # long, so emulation must not wait for them a second time.
    os.environ["TESSERA_EMULATE_LINKS"] = "0"
    block = costs.parts["block"]
    scale = costs.ref_tflops / 4.0
    os.environ["TESSERA_EMULATE_BLOCK"] = f"{block.call_s * scale},{block.forward_s * scale},{costs.backward_ratio}"
    for rep in range(args.reps):
        for name, (plan, cluster, cluster_spec) in plans.items():
            path = tmp / f"{name.replace(' ', '_')}.yaml"
            path.write_text(yaml.safe_dump(cluster_spec))
            os.environ["TESSERA_EMULATE"] = str(path)
            out = run_ranks(train_worker, cluster.world_size, plan.to_dict(), args.steps, timeout_s=900)[0]
            measured[name].append(out["step_s"])
            notes[name] = {"emulated_rank0": out["emulated"], "losses": out["losses"]}
            print(f"rep {rep} {name:10s} {out['step_s']:.3f} s/step", flush=True)
    rows = {}
    for name, (plan, cluster, _) in plans.items():
        step = statistics.median(measured[name])
        predicted = estimate(layout_from_plan(plan, cluster, costs, BATCH), costs).step_s
        rows[name] = {
            "plan": plan_summary(plan),
            "measured_step_s": step,
            "tokens_per_s": BATCH * SEQ / step,
            "predicted_step_s": predicted,
            "predicted_over_measured": predicted / step,
            "runs_s": measured[name],
            **notes[name],
        }
    for name, row in rows.items():
        print(
            f"{name:10s} measured {row['measured_step_s']:.3f} s/step = {row['tokens_per_s']:7.0f} tokens/s "
            f"(x{row['tokens_per_s'] / rows['planned']['tokens_per_s']:.2f} planned)  predicted "
            f"{row['predicted_step_s']:.3f} s ({row['predicted_over_measured'] - 1:+.1%})"
        )
    print(
        f"EMULATED cluster: speeds 1, 1/4, 1/4 by sleeping (time scale {args.time_scale}); small memory {SMALL_GIB} GiB"
    )
    if args.json:
        Path(args.json).write_text(json.dumps({"time_scale": args.time_scale, "rows": rows}, indent=2, default=str))


if __name__ == "__main__":
    main()
