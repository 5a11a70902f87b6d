"""The planner: regret against exhaustive search, search time as clusters grow, and a memory-bound case.

Part a (regret): on generated clusters of at most 8 devices (2-3 nodes, six device types, two of
them small-memory), the planner's best plan against the oracle: the simulator's minimum,
exhaustive over the same space the planner searches (every placement, split, share vector and
option; for replicas of different depth, the best shares of every depth choice). The simulator
is written apart from the cost model the search uses (tessera/planner/simulate.py). Two
planners: the default (placements enumerated on small clusters) and the large-cluster heuristic
alone (canonical placements only).
Model: a 4-layer Llama, hidden 2048, seq 2048, fp16, global batch 8.

Part b (search time): regular clusters of 16 to 4,096 devices, 8 per node, six device types in
turn (H100, A100-80GB, A100-40GB, L4, A10, RTX4090), three regions; a Llama-70B-shaped model
(80 layers, hidden 8192, 64 heads, 8 KV heads, FFN 28672, vocab 128256, seq 4096, bf16), global
batch 512. Median of --reps searches on one core.

Part c (search time on a family it was not tuned on): ``family_cluster`` shapes, 16 to 4,096
devices, 1/2/4/8 devices per node, 2-6 device types with uneven node counts, 1-4 regions; the
same 70B model from 256 devices, an 8B one (Llama-3-8B shape) below, where 70B fits nowhere;
precision chosen as ``tessera plan`` does (fp16 where a type has no bf16). One search each on
one core.

Part s (scale: what ``tessera plan`` runs, on shapes it was not tuned on): ``scale_cluster`` seeds 0-39,
16 to 4,096 devices: often every node with 8 devices, 1-3 types holding most nodes, host-like node names,
1-3 regions of very different sizes, link rates drawn per cluster and up to 64 node pairs with links of
their own. The whole ``plan_for`` (grid search, groups per region, subsets without the slowest devices,
replicas of different depth), once per shape, one thread; run it under ``taskset -c 0`` for one core.
70B from 256 devices, 8B below; precision as ``tessera plan`` chooses it.

Part scale-small: the same generator capped at 64 and 128 devices with the small model of the test that
plans thirty of its shapes (8 layers, hidden 1024, batch 256): there the search per region and the replicas
of different depth run on every shape.

Part d (memory binds): two types, a fast device with little memory and a slow one with a lot.
A 2.2 B-parameter Llama, fp32 Adam: the speed-proportional plan (uneven shares, plain DDP) does
not fit the fast device; the planner's plan, and what it chose instead.

Part e (the outer level): the same 70B model on 4,608 H100 (8 a node) in 3 regions of 1,536 made
alike, joined by the default inter-region link (1 GB/s, 50 ms), global batch 1,536: the best plan
without groups (gradients cross the regions every step) and with one group per region (the outer
sync the planner picks), with what crosses the regions a step. Then the issue's own shape, whose
regions are not alike: part b's 4,096 devices (512 nodes of six types, three regions), each region
planned alone as a fault-tolerant group of its own layout (``unlike_region_candidates``).

    python benchmarks/planner.py [--part all|regret|time|family|scale|scale-small|memory|regions]
        [--reps 3] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

import torch

from tessera import Hybrid, PlanError
from tessera.cluster import Cluster
from tessera.cluster.generate import random_cluster, regular_cluster
from tessera.models.llama import Llama, LlamaConfig
from tessera.planner.costmodel import estimate
from tessera.planner.costs import ModelCosts
from tessera.planner.layout import layout_from_plan
from tessera.planner.search import exhaustive_search, search
from tessera.planner.simulate import simulate

# The model shapes the time parts plan: Llama-70B's and Llama-3-8B's.
LLAMA_70B = {"n_layers": 80, "dim": 8192, "n_heads": 64, "n_kv_heads": 8, "ffn_dim": 28672, "vocab_size": 128256}
LLAMA_8B = {"n_layers": 32, "dim": 4096, "n_heads": 32, "n_kv_heads": 8, "ffn_dim": 14336, "vocab_size": 128256}


def _costs(precision: str, seq: int, **config: Any) -> ModelCosts:
    with torch.device("meta"):
        model = Llama(LlamaConfig(max_seq_len=seq, **config))
    return ModelCosts.from_model(model, seq_len=seq, precision=precision)


def regret(n_clusters: int) -> dict:
    costs = _costs("fp16", 2048, n_layers=4, dim=2048, n_heads=16, n_kv_heads=16, ffn_dim=8192, vocab_size=32000)
    rows = []
    for seed in range(n_clusters):
        cluster = random_cluster(seed)
        t0 = time.perf_counter()
        # the oracle: the simulator's minimum, exhaustive over the same space the planner searches
        oracle, _ = exhaustive_search(
            cluster, costs, 8, microbatches=(1, 2, 4), judge=lambda layout: simulate(layout, costs).step_s
        )
        exhaustive_s = time.perf_counter() - t0
        row = {"seed": seed, "devices": cluster.world_size, "types": sorted({n.device_type for n in cluster.nodes})}
        for name, limit in (("planner", None), ("heuristic", 0)):
            kwargs = {} if limit is None else {"placement_limit": limit}
            t0 = time.perf_counter()
            chosen = search(cluster, costs, 8, top=1, microbatches=(1, 2, 4), **kwargs)[0]
            row[f"{name}_s"] = time.perf_counter() - t0
            row[f"{name}_regret"] = simulate(chosen.layout, costs).step_s / oracle - 1
        row["exhaustive_s"] = exhaustive_s
        rows.append(row)
        print(
            f"seed {seed:2d}  {row['devices']} devices {'/'.join(row['types']):32s} planner regret "
            f"{row['planner_regret']:+.4f} ({row['planner_s']:.2f} s)  heuristic {row['heuristic_regret']:+.4f} "
            f"({row['heuristic_s']:.2f} s)  exhaustive {exhaustive_s:.1f} s",
            flush=True,
        )
    summary = {
        f"{name}_{stat}": f([r[f"{name}_regret"] for r in rows])
        for name in ("planner", "heuristic")
        for stat, f in (("worst", max), ("median", statistics.median))
    }
    print("summary", json.dumps(summary))
    return {"rows": rows, **summary}


def search_time(reps: int) -> dict:
    costs = _costs("bf16", 4096, **LLAMA_70B)
    types = ("H100", "A100-80GB", "A100-40GB", "L4", "A10", "RTX4090")
    rows = []
    for devices in (16, 64, 256, 1024, 4096):
        cluster = regular_cluster(devices, types, regions=3)
        times, best = [], None
        for _ in range(reps):
            t0 = time.perf_counter()
            best = search(cluster, costs, 512, top=3)[0]
            times.append(time.perf_counter() - t0)
        p = best.plan
        row = {
            "devices": devices,
            "median_s": statistics.median(times),
            "times_s": times,
            "best": f"dp{p.dp} tp{p.tp} pp{p.pp} zero{p.zero} m{p.pipeline.microbatches} {p.recompute}",
            "step_s": best.estimate.step_s,
            "bottleneck": best.estimate.bottleneck,
        }
        rows.append(row)
        print(
            f"{devices:5d} devices  search {row['median_s']:.2f} s  best {row['best']}  {row['step_s']:.3g} s/step",
            flush=True,
        )
    return {"rows": rows}


def family_time(seeds: int, sizes: tuple[int, ...]) -> dict:
    """Search time on generated clusters unlike part b's: ``family_cluster`` (1/2/4/8 devices per node,
    2-6 types with uneven node counts, 1-4 regions), precision chosen as ``tessera plan`` does."""
    from tessera.cluster.generate import family_cluster
    from tessera.planner.precision import choose_precision

    big = _costs("bf16", 4096, **LLAMA_70B)
    small = _costs("bf16", 4096, **LLAMA_8B)
    rows = []
    for devices in sizes:
        for seed in range(seeds):
            cluster = family_cluster(1000 * devices + seed, devices)
            precision, _ = choose_precision(cluster, "auto")
            # a 70B model does not fit on 16-64 small GPUs: those plan an 8B one (Llama-3-8B shape)
            model, base = ("70B", big) if devices >= 256 else ("8B", small)
            costs = base.with_precision(precision)
            row: dict[str, Any] = {
                "model": model,
                "devices": devices,
                "seed": 1000 * devices + seed,
                "nodes": len(cluster.nodes),
                "per_node": sorted({n.count for n in cluster.nodes}),
                "types": sorted({n.device_type for n in cluster.nodes}),
                "regions": len({n.region for n in cluster.nodes}),
                "precision": precision,
            }
            t0 = time.perf_counter()
            try:
                best = search(cluster, costs, 512, top=3)[0]
                p = best.plan
                row["best"] = f"dp{p.dp} tp{p.tp} pp{p.pp} zero{p.zero} m{p.pipeline.microbatches} {p.recompute}"
                if p.placement is not None and len(p.placement) < devices:
                    row["best"] += f" on {len(p.placement)} of {devices}"
            except PlanError as exc:
                row["best"] = f"no plan: {str(exc)[:80]}"
            row["search_s"] = time.perf_counter() - t0
            rows.append(row)
            print(
                f"{model:3s} {devices:5d} devices {row['nodes']:4d} nodes per-node {row['per_node']} "
                f"{len(row['types'])} types {row['regions']} regions {precision}: {row['search_s']:.2f} s  "
                f"{row['best']}",
                flush=True,
            )
    return {"rows": rows, "worst_s": max(r["search_s"] for r in rows)}


def scale_time(seeds: int) -> dict:
    """What ``tessera plan`` runs (``plan_for``: the grid search, groups per region, smaller subsets, mixed
    depths) on ``scale_cluster`` shapes of up to 4,096 devices, one planning each, on one core."""
    from tessera.cluster.generate import scale_cluster
    from tessera.planner import plan_for
    from tessera.planner.precision import choose_precision

    with torch.device("meta"):
        shapes = {"70B": Llama(LlamaConfig(max_seq_len=4096, **LLAMA_70B)),
                  "8B": Llama(LlamaConfig(max_seq_len=4096, **LLAMA_8B))}  # fmt: skip
    rows = []
    for seed in range(seeds):
        cluster = scale_cluster(seed)
        precision, _ = choose_precision(cluster, "auto")
        name = "70B" if cluster.world_size >= 256 else "8B"  # a 70B model fits on no small cluster here
        row: dict[str, Any] = {
            "seed": seed,
            "model": name,
            "devices": cluster.world_size,
            "nodes": len(cluster.nodes),
            "per_node": sorted({n.count for n in cluster.nodes}),
            "types": len({n.device_type for n in cluster.nodes}),
            "regions": len({n.region for n in cluster.nodes}),
            "pair_links": len(cluster.pair_links),
        }
        t0 = time.perf_counter()
        try:
            best = plan_for(cluster, shapes[name], 512, precision=precision, pin_precision=True)[0]
            p = best.plan
            row["best"] = f"dp{p.dp} tp{p.tp} pp{p.pp} zero{p.zero} ({best.placement[:60]})"
            row["step_s"] = best.estimate.step_s
        except PlanError as exc:
            row["best"] = f"no plan: {str(exc)[:80]}"
        row["plan_s"] = time.perf_counter() - t0
        rows.append(row)
        print(
            f"seed {seed:2d} {name:3s} {row['devices']:5d} devices {row['nodes']:4d} nodes {row['types']} types "
            f"{row['regions']} regions {row['pair_links']:2d} pair links: {row['plan_s']:.2f} s  {row['best']}",
            flush=True,
        )
    times = sorted(r["plan_s"] for r in rows)
    return {"rows": rows, "slowest_s": times[-1], "median_s": statistics.median(times)}


def scale_small_time(seeds: int, caps: tuple[int, ...] = (64, 128)) -> dict:
    """Part s at small scale: the same generator capped at ``caps`` devices with the small model of
    tests/test_planner.py's thirty-shape test (8 layers, hidden 1024, batch 256), where a search per region
    and the replicas of different depth (up to 64 devices) both run; one ``plan_for`` each."""
    from tessera.cluster.generate import scale_cluster
    from tessera.planner import plan_for
    from tessera.planner.precision import choose_precision

    with torch.device("meta"):
        model = Llama(LlamaConfig(n_layers=8, dim=1024, n_heads=16, n_kv_heads=4, ffn_dim=4096, max_seq_len=1024))
    rows = []
    for cap in caps:
        for seed in range(seeds):
            cluster = scale_cluster(seed, max_devices=cap)
            precision, _ = choose_precision(cluster, "auto")
            t0 = time.perf_counter()
            best = plan_for(cluster, model, 256, precision=precision, pin_precision=True)[0]
            row = {"cap": cap, "seed": seed, "devices": cluster.world_size, "nodes": len(cluster.nodes),
                   "plan_s": time.perf_counter() - t0, "step_s": best.estimate.step_s}  # fmt: skip
            rows.append(row)
            print(f"cap {cap:3d} seed {seed:2d} {row['devices']:4d} devices {row['nodes']:3d} nodes: "
                  f"{row['plan_s']:.2f} s, best {row['step_s']:.4g} s/step", flush=True)  # fmt: skip
    times = sorted(r["plan_s"] for r in rows)
    return {"rows": rows, "slowest_s": times[-1], "median_s": statistics.median(times)}


def memory_bound() -> dict:
    costs = _costs("fp32", 1024, n_layers=16, dim=3072, n_heads=24, n_kv_heads=24, ffn_dim=8192, vocab_size=32000)
    cluster = Cluster.from_dict(
        {
            "nodes": [
                {"name": "fast", "devices": [{"type": "quick", "count": 2}]},
                {"name": "big", "devices": [{"type": "roomy", "count": 2}]},
            ],
            "device_types": {
                "quick": {"peak_tflops": {"fp32": 80}, "memory_gib": 24, "bandwidth_gbs": 1000},
                "roomy": {"peak_tflops": {"fp32": 20}, "memory_gib": 80, "bandwidth_gbs": 2000},
            },
        }
    )
    params = costs.stage_params(0, costs.n_layers)
    # The speed-proportional plan: shares 4:4:1:1 of 40, plain DDP.
    naive = estimate(layout_from_plan(Hybrid(dp_shares=[16, 16, 4, 4]), cluster, costs, 40), costs)
    best = search(cluster, costs, 40, top=3)
    out = {
        "params": params,
        "naive_fits": naive.fits,
        "naive_step_s": naive.step_s,
        "naive_memory_gib": [round(m.total / 2**30, 1) for m in naive.memory],
        "capacity_gib": [round(m.capacity / 2**30, 1) for m in naive.memory],
        "best": [],
    }
    print(f"{params / 1e9:.2f} B parameters, fp32 Adam: {16 * params / 2**30:.0f} GiB of model state")
    print(
        f"speed-proportional DDP 16:16:4:4: fits={naive.fits}, "
        f"memory GiB {out['naive_memory_gib']} of {out['capacity_gib']}"
    )
    for c in best:
        p, e = c.plan, c.estimate
        row = {
            "plan": f"dp{p.dp} tp{p.tp} pp{p.pp} zero{p.zero} offload={p.offload} m{p.pipeline.microbatches} "
            f"recompute={p.recompute} shares={p.dp_shares} stages={p.pipeline.stages} placement={p.placement}",
            "step_s": e.step_s,
            "memory_gib": [round(m.total / 2**30, 1) for m in e.memory],
            "capacity_gib": [round(m.capacity / 2**30, 1) for m in e.memory],
            "bottleneck": e.bottleneck,
        }
        out["best"].append(row)
        print(f"  {row['step_s']:.3g} s/step  {row['plan']}")
        print(f"    memory GiB {row['memory_gib']} of {row['capacity_gib']}; {row['bottleneck']}")
    return out


def regions_outer() -> dict:
    """Part e: predicted step of the 70B shape on 3 alike regions, without and with the outer level."""
    from tessera.planner.outer import outer_candidates

    costs = _costs("bf16", 4096, **LLAMA_70B)
    cluster, batch = regular_cluster(4608, ("H100",), regions=3), 1536
    start = time.perf_counter()
    flat = search(cluster, costs, batch, top=1)[0]
    flat_s = time.perf_counter() - start
    start = time.perf_counter()
    (grouped,) = outer_candidates(cluster, costs, batch, top=1)
    grouped_s = time.perf_counter() - start
    rows = {}
    for name, c, took in (("without groups", flat, flat_s), ("a group per region", grouped, grouped_s)):
        p, e = c.plan, c.estimate
        sync = max(e.sync_s) if e.sync_s else 0.0
        rows[name] = {
            "plan": f"dp{p.dp} tp{p.tp} pp{p.pp} zero{p.zero} m{p.pipeline.microbatches}"
            + (
                f", {p.groups.count} groups {p.groups.sync} H={p.groups.inner_steps} F={p.groups.fragments}"
                if p.groups
                else ""
            ),
            "step_s": e.step_s,
            "tokens_per_s": e.tokens_per_s,
            "grad_sync_s": sync,
            "outer_sync_s": e.breakdown.get("outer_sync_s", 0.0),
            "bottleneck": e.bottleneck,
            "notes": list(c.notes),
            "search_s": took,
        }
        print(f"{name}: {e.step_s:.3g} s/step ({e.tokens_per_s:,.0f} tokens/s), {rows[name]['plan']}; {e.bottleneck}")
    for note in grouped.notes:
        print(f"  note: {note}")
    rows["4,096 devices, regions not alike"] = unlike_regions(costs)
    return rows


def unlike_regions(costs: Any) -> dict:
    """Part e, the issue's shape: part b's 4,096-device cluster (six types, three regions not alike) without
    groups and with a fault-tolerant group per region, each laid out its own way."""
    from tessera.planner.outer import unlike_region_candidates

    types = ("H100", "A100-80GB", "A100-40GB", "L4", "A10", "RTX4090")
    cluster, batch = regular_cluster(4096, types, regions=3), 1536
    start = time.perf_counter()
    flat = search(cluster, costs, batch, top=1)[0]
    flat_s = time.perf_counter() - start
    start = time.perf_counter()
    (grouped,) = unlike_region_candidates(cluster, costs, batch)
    grouped_s = time.perf_counter() - start
    p, g = flat.plan, grouped.plan.groups
    assert g is not None and g.layouts is not None
    out = {
        "without groups": {
            "plan": f"dp{p.dp} tp{p.tp} pp{p.pp} zero{p.zero} m{p.pipeline.microbatches}",
            "step_s": flat.estimate.step_s,
            "tokens_per_s": flat.estimate.tokens_per_s,
            "bottleneck": flat.estimate.bottleneck,
            "search_s": flat_s,
        },
        "a group per region": {
            "groups": [
                f"{g.sizes[i] if g.sizes else '?'} ranks, {g.shares[i] if g.shares else '?'} samples: "
                f"tp{q.tp} pp{q.pp} zero{q.zero} m{q.pipeline.microbatches}"
                for i, q in enumerate(grouped.plan.group_plan(i) for i in range(g.count))
            ],
            "sync": f"{g.sync} H={g.inner_steps}",
            "step_s": grouped.estimate.step_s,
            "tokens_per_s": grouped.estimate.tokens_per_s,
            "outer_sync_s": grouped.estimate.breakdown.get("outer_sync_s", 0.0),
            "notes": list(grouped.notes),
            "search_s": grouped_s,
        },
    }
    for name, row in out.items():
        print(f"4,096 devices, {name}: {row['step_s']:.3g} s/step ({row['tokens_per_s']:,.0f} tokens/s), "
              f"search {row['search_s']:.1f} s")  # fmt: skip
    print(f"  note: {grouped.notes[-1]}")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--part",
        default="all",
        choices=("all", "regret", "time", "family", "scale", "scale-small", "memory", "regions"),
    )
    ap.add_argument("--scale-seeds", type=int, default=40, help="scale_cluster shapes planned in part scale")
    ap.add_argument("--family-seeds", type=int, default=3, help="generated clusters per size in part family")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--clusters", type=int, default=24)
    ap.add_argument("--json")
    args = ap.parse_args()
    torch.set_num_threads(1)
    result: dict[str, Any] = {}
    if args.part in ("all", "regret"):
        result["regret"] = regret(args.clusters)
    if args.part in ("all", "time"):
        result["search_time"] = search_time(args.reps)
    if args.part in ("all", "family"):
        result["family_time"] = family_time(args.family_seeds, (16, 24, 64, 256, 1024, 4096))
    if args.part in ("all", "scale"):
        result["scale_time"] = scale_time(args.scale_seeds)
    if args.part in ("all", "scale-small"):
        result["scale_small_time"] = scale_small_time(args.scale_seeds)
    if args.part in ("all", "memory"):
        result["memory_bound"] = memory_bound()
    if args.part in ("all", "regions"):
        result["regions_outer"] = regions_outer()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2, default=str)


if __name__ == "__main__":
    try:
        main()
    except PlanError as exc:
        raise SystemExit(f"error: {exc}") from None
