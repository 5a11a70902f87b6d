"""Experts placed by device speed vs evenly, on the testbed: real CPU quotas 1 : 1 : ½ : ½ (issue 16).

Every rank runs `tessera train --testbed` in a CPU cgroup whose quota is its device's share of
``--cpus`` cores (two "full" devices on node a, two "half" on node b, joined by a shaped link). The
same MoE Llama (8 experts, top-2, the experts most of the compute) trains with the same global batch,
split 2 : 2 : 1 : 1 by speed in every plan (``dp_shares``), under three plans, interleaved:

- *replicated*: ``ep=1``, every rank holds every expert and runs its own tokens' (DDP all-reduces
  the experts' gradients);
- *even*: ``ep=4``, two experts per rank;
- *planned*: ``ep=4`` with ``expert_shares`` from the planner (``tessera.planner.experts.with_experts``
  on the cluster file: experts by speed and memory, 3 : 3 : 1 : 1).

Reported: the median step time over steps 3.. of each run (rank 0's ``step_time_s``), tokens/s and
ratios; and the planner's prediction for even and planned, calibrated on the replicated run alone (its
step split into dense and expert work by their FLOPs, the device speed fitted to it), so the two
predictions are checked against measurements they did not see.

    sudo python benchmarks/moe_placement.py [--reps 3] [--steps 12] [--json docs/moe_placement.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path
from typing import Any

import yaml
from testbed_cluster import SEQ, TYPES, run

BATCH = 24
MODEL = {"dim": 128, "n_layers": 4, "n_heads": 4, "n_kv_heads": 2, "ffn_dim": 512, "moe": {"experts": 8, "top_k": 2}}
SAMPLES = [2, 2, 1, 1]  # the global batch split by speed in every plan


def cluster_spec(link_mbit: float) -> dict:
    link = {"bandwidth_gbs": link_mbit / 8e3, "latency_us": 100}
    return {
        "nodes": [
            {"name": "a", "devices": [{"type": "full", "count": 2}]},
            {"name": "b", "devices": [{"type": "half", "count": 2}]},
        ],
        "device_types": {k: TYPES[k] for k in ("full", "half")},
        "links": {"inter_node": link, "inter_region": link},
    }


def planned_plan(spec: dict) -> tuple[Any, Any, Any, Any]:
    """The planner's placement for the DDP plan with samples 2:2:1:1, and what it reads."""
    import torch

    from tessera import Plan
    from tessera.cluster.spec import Cluster
    from tessera.config import parse_config
    from tessera.models.build import build_model
    from tessera.planner.costs import ModelCosts
    from tessera.planner.experts import expert_costs, with_experts

    with torch.device("meta"):
        model = build_model(parse_config({"model": MODEL, "data": {"seq_len": SEQ}}))
    cluster = Cluster.from_dict(spec)
    experts = expert_costs(model)
    base = Plan(dp=4, dp_shares=tuple(SAMPLES))
    placed, _, _ = with_experts(base, 4, cluster, experts, SEQ, BATCH, "fp32")
    return placed, cluster, experts, ModelCosts.from_model(model, SEQ)


def predict(replicated_s: float, cluster: Any, experts: Any, costs: Any, shares: dict[str, Any]) -> dict[str, float]:
    """Step times predicted from the replicated run: its step, less its predicted gradient all-reduces, is
    dense plus expert compute in the ratio of their FLOPs (every rank's work is equal under the 2:2:1:1
    split); the speed fitted there prices the other plans' dense work and experts (``expert_seconds``: the
    slowest rank's share of every slot, and the all-to-alls; their experts' gradients stay home)."""
    import dataclasses

    from tessera.data.sharding import split_batch
    from tessera.planner.experts import expert_seconds

    samples = split_batch(BATCH, SAMPLES)
    speeds = [t.peak("fp32") for _, _, t in cluster.devices()]
    link = cluster.worst_link({n for n, _, _ in cluster.devices()})
    block = costs.parts["block"].forward_s * costs.n_layers  # per sample, on a 1-TFLOP/s device, dense + experts
    expert_part = experts.layers * experts.top_k * SEQ * experts.slot_s  # of that, per sample
    dense_params = sum(p.params for p in costs.parts.values()) - experts.experts * experts.params * experts.layers
    dense_sync = link.all_reduce_s(dense_params * 4, len(samples))
    replicated = expert_seconds(experts, SEQ, samples, speeds, None, link)  # its exchange: the experts' all-reduce
    work = samples[0] / speeds[0] * (1 + costs.backward_ratio)
    unscaled = {"dense": (block - expert_part) * work, "experts": expert_part * work}
    scale = (replicated_s - dense_sync - replicated.exchange_s) / (unscaled["dense"] + unscaled["experts"])
    out = {}
    for name, held in shares.items():
        scaled = dataclasses.replace(experts, slot_s=experts.slot_s * scale)
        out[name] = (
            unscaled["dense"] * scale + dense_sync + expert_seconds(scaled, SEQ, samples, speeds, held, link).total_s
        )
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--cpus", type=float, default=1.65)
    ap.add_argument("--link-mbit", type=float, default=1000.0)
    ap.add_argument("--json")
    args = ap.parse_args()

    work = Path(tempfile.mkdtemp(prefix="moe-placement-"))
    spec = cluster_spec(args.link_mbit)
    cluster_file = work / "cluster.yaml"
    cluster_file.write_text(yaml.safe_dump(spec))
    placed, cluster, experts, costs = planned_plan(spec)
    print(f"planner: experts held {list(placed.expert_shares)} on speeds 1, 1, 1/2, 1/2")
    common = {"preset": "ddp", "dp_shares": SAMPLES}
    plans = {
        "replicated": common,
        "even": {**common, "ep": 4},
        "planned": {**common, "ep": 4, "expert_shares": list(placed.expert_shares)},
    }
    measured: dict[str, list[float]] = {name: [] for name in plans}
    for rep in range(args.reps):
        for name, plan in plans.items():  # interleaved
            step = run(work, name, plan, 4, cluster_file, args.cpus, args.steps, BATCH, MODEL)
            measured[name].append(step)
            print(f"rep {rep} {name:10s} {step:.3f} s/step", flush=True)
    steps = {name: statistics.median(runs) for name, runs in measured.items()}
    predicted = predict(steps["replicated"], cluster, experts, costs,
                        {"even": (2, 2, 2, 2), "planned": placed.expert_shares})  # fmt: skip
    rows = {}
    for name, step in steps.items():
        rows[name] = {"plan": plans[name], "measured_step_s": step, "runs_s": measured[name],
                      "tokens_per_s": BATCH * SEQ / step, "predicted_step_s": predicted.get(name)}  # fmt: skip
        line = f"{name:10s} {step:.3f} s/step = {BATCH * SEQ / step:6.0f} tokens/s"
        line += f" (x{steps['even'] / step:.2f} even, x{steps['replicated'] / step:.2f} replicated)"
        if name in predicted:
            line += f"; predicted {predicted[name]:.3f} s ({predicted[name] / step - 1:+.0%})"
        print(line)
    if args.json:
        out = {"cpus": args.cpus, "link_mbit": args.link_mbit, "global_batch": BATCH, "seq": SEQ, "model": MODEL}
        out["rows"] = rows
        Path(args.json).write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
