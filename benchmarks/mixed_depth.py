"""Replicas of different depth (the Zorse shape) on an emulated 3-device cluster where memory binds.

One "big" device (speed 1, ample memory) and two "small" ones (speed ¼, too little memory for
the whole model, enough for half of it), played by three local CPU ranks
(``tessera.testbed.emulate``; EMULATED: the numbers are about scheduling work over devices of
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

from emulated_cluster import BATCH, arguments, calibrate, compare, profiled_costs

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
    args = arguments(__doc__.splitlines()[0])

    from tessera import DDP
    from tessera.cluster import Cluster
    from tessera.planner.search import search

    costs = profiled_costs(args.time_scale)
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
    chosen_by = {
        "planned": "tessera.planner.search.search (the cost model): its best",
        "mixed": "tessera.planner.search.search: its best with replicas of different depth",
        "mixed m>=2": "tessera.planner.search.search: its best of those with 2+ micro-batches",
        "drop small": "fixed: DDP() on the fast node",
    }
    compare(plans, costs, args, baseline="planned", chosen_by=chosen_by)
    print(
        f"EMULATED cluster: speeds 1, 1/4, 1/4 by sleeping (time scale {args.time_scale}); small memory {SMALL_GIB} GiB"
    )


if __name__ == "__main__":
    main()
