"""Planned vs uniform vs drop-the-slow-devices on an emulated 4-device cluster (speeds 1, 1, ½, ¼).

Four local CPU ranks play the devices of a cluster file (``tessera.testbed.emulate``): every
transformer block sleeps so that it takes ``slowdown`` times this CPU's compute, ``slowdown`` =
time_scale × (fastest peak / device peak). EMULATED: the numbers are about scheduling work over
devices of different speed, not about any real GPU.

The model is the reference Llama (8 layers, hidden 128, vocabulary 256, sequence 64), global
batch 32, fp32 AdamW. Costs for the planner are this CPU's profile of the model (times
time_scale, scaled by peak per device). Three plans, run in turn, --reps times each:

- planned: ``tessera.Auto`` on the cluster (uneven shares/stages, placement as it chooses);
- uniform: DDP with equal shares on all four devices;
- drop slow: DDP with equal shares on the two fast devices only (a 2-device cluster).

Reported: measured median step time and tokens/s (median over steps 3.. of each run, then over
runs), the planner's predicted step time for each plan, and the ratios; per row, which function
chose the plan and the share of its predicted step the emulator paces with the cost model's own
block times (a match within that share confirms nothing about the planner). What emulation does not
stretch is calibrated on this machine first and written into the cluster file: the gloo
all-reduce bandwidth and the latency of a tiny collective between the local ranks, and the
optimizer step's speed.

    python benchmarks/emulated_cluster.py [--reps 3] [--steps 8] [--time-scale 8] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
import yaml

TYPES = {
    "full": {"peak_tflops": {"fp32": 4}, "memory_gib": 8, "bandwidth_gbs": 100},
    "half": {"peak_tflops": {"fp32": 2}, "memory_gib": 8, "bandwidth_gbs": 100},
    "quarter": {"peak_tflops": {"fp32": 1}, "memory_gib": 8, "bandwidth_gbs": 100},
}
LINKS = {"intra_node": {"bandwidth_gbs": 1, "latency_us": 200}, "inter_node": {"bandwidth_gbs": 1, "latency_us": 200}}
FOUR = {
    "nodes": [
        {"name": "a", "devices": [{"type": "full", "count": 2}]},
        {"name": "b", "devices": [{"type": "half", "count": 1}]},
        {"name": "c", "devices": [{"type": "quarter", "count": 1}]},
    ],
    "device_types": TYPES,
    "links": LINKS,
}
SEQ, BATCH = 64, 32


def build_model() -> torch.nn.Module:
    from tessera.models.llama import Llama, LlamaConfig

    torch.manual_seed(0)
    return Llama(
        LlamaConfig(vocab_size=256, dim=128, n_layers=8, n_heads=4, n_kv_heads=2, ffn_dim=256, max_seq_len=SEQ)
    )


class Tokens(torch.utils.data.Dataset):
    def __init__(self, n: int = 4096) -> None:
        self.data = torch.randint(0, 256, (n, SEQ + 1), generator=torch.Generator().manual_seed(0))

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"x": self.data[i, :-1], "y": self.data[i, 1:]}


def loss_fn(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), y.flatten())


def plan_summary(plan: Any) -> dict:
    """The Plan's fields that are not at a default-like value (``True`` is kept: it is not ``1`` here)."""

    def default(v: Any) -> bool:
        return v is None or v is False or v in ("auto", "none") or (type(v) is int and v == 1)

    return {k: v for k, v in plan.to_dict().items() if not default(v)}


def train_worker(plan_dict: dict, steps: int) -> dict:
    import torch.distributed as dist

    import tessera
    from tessera.testbed.emulate import hooks_from_environment

    torch.set_num_threads(1)
    hooks = hooks_from_environment()
    booster = tessera.Booster(tessera.Plan.from_dict(plan_dict), hooks=hooks)
    model = build_model()
    model, opt = booster.boost(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    loader = iter(booster.dataloader(Tokens(), global_batch_size=BATCH, seed=0))
    times, losses = [], []
    for _ in range(steps):
        dist.barrier()
        t0 = time.perf_counter()
        loss = booster.execute_pipeline(loader, model, loss_fn, opt)
        opt.step()
        opt.zero_grad()
        dist.barrier()
        times.append(time.perf_counter() - t0)
        losses.append(float(booster.reduce_loss(loss)))
    return {"step_s": statistics.median(times[2:]), "losses": losses, "emulated": hooks.describe() if hooks else None}


def links_worker() -> dict:
    from tessera.planner.profile import measure_links

    return measure_links(sizes=(1 << 22,), repeats=5)


def calibrate(cluster_spec: dict, costs_params: int) -> dict:
    """The cluster file with this machine's real figures for what emulation does not stretch:
    gloo all-reduce bandwidth between the local ranks, and the optimizer step's speed (as the
    memory bandwidth the cost model divides 16 bytes per parameter by)."""
    from tessera.testing import run_ranks

    links = run_ranks(links_worker, 4)[0]
    bus, latency_us = links["all_reduce"][1 << 22], links["latency_us"][4]
    model = build_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    opt.step()
    t0 = time.perf_counter()
    for _ in range(5):
        opt.step()
    step = (time.perf_counter() - t0) / 5
    bandwidth = 16 * costs_params / step / 1e9
    link = {"bandwidth_gbs": round(bus, 3), "latency_us": round(latency_us, 1)}
    types = {name: {**t, "bandwidth_gbs": round(bandwidth, 3)} for name, t in cluster_spec["device_types"].items()}
    print(
        f"calibrated: gloo all-reduce {bus:.2f} GB/s (bus), a tiny broadcast in a burst {latency_us:.0f} us, "
        f"AdamW step {step * 1e3:.1f} ms = {bandwidth:.2f} GB/s"
    )
    return {**cluster_spec, "device_types": types, "links": {"intra_node": link, "inter_node": link}}


def arguments(description: str) -> argparse.Namespace:
    """The command line every emulated benchmark takes."""
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--time-scale", type=float, default=8.0)
    ap.add_argument("--json")
    return ap.parse_args()


def profiled_costs(time_scale: float) -> Any:
    """This CPU's profile of the model, as costs on the fastest emulated device (4 TFLOP/s × time_scale)."""
    from tessera.planner.costs import ModelCosts
    from tessera.planner.profile import profile_model

    torch.set_num_threads(1)
    profile = profile_model(build_model(), batch_sizes=(1, 2, 4, 8, 16), seq_len=SEQ, repeats=7)
    return ModelCosts.from_profile(profile, peak_tflops=4.0 * time_scale, hidden=128)


def paced_share(plan: Any, cluster: Any, costs: Any) -> float:
    """The share of the cost model's predicted step that the emulator paces itself: the step less the
    same prediction with the blocks' compute (what emulation sleeps for) taken out, over the step. A
    measurement that matches a prediction by this share is agreeing with the cost model's own numbers."""
    from dataclasses import replace

    from tessera.planner.costmodel import estimate
    from tessera.planner.layout import layout_from_plan

    step = estimate(layout_from_plan(plan, cluster, costs, BATCH), costs).step_s
    parts = {**costs.parts, "block": replace(costs.parts["block"], forward_s=0.0, call_s=0.0)}
    unpaced = replace(costs, parts=parts, _memo={})
    return 1.0 - estimate(layout_from_plan(plan, cluster, unpaced, BATCH), unpaced).step_s / step


def compare(
    plans: dict[str, tuple], costs: Any, args: argparse.Namespace, baseline: str, chosen_by: dict[str, str]
) -> dict[str, dict]:
    """Run ``plans`` (name → (Plan, Cluster, cluster spec)) in turn, ``args.reps`` times each, on emulated
    devices paced by ``costs``; print and return each plan's measured and predicted step, which function
    chose it (``chosen_by``) and the share of the prediction the emulator paces itself."""
    from tessera.planner.costmodel import estimate
    from tessera.planner.layout import layout_from_plan
    from tessera.testing import run_ranks

    tmp = Path(tempfile.mkdtemp())
    measured: dict[str, list[float]] = {name: [] for name in plans}
    notes: dict[str, Any] = {}
    os.environ["TESSERA_EMULATE_SCALE"] = str(args.time_scale)
    # The cluster's links are this machine's own, measured by calibrate(): the real transfers already
    # take that long, so emulation must not wait for them a second time.
    os.environ["TESSERA_EMULATE_LINKS"] = "0"
    block = costs.parts["block"]  # blocks take the profiled line (× time scale), not this run's noisy CPU time
    scale = costs.ref_tflops / 4.0
    os.environ["TESSERA_EMULATE_BLOCK"] = f"{block.call_s * scale},{block.forward_s * scale},{costs.backward_ratio}"
    for rep in range(args.reps):
        for name, (plan, cluster, spec) in plans.items():  # interleaved: rep 0 of each, then rep 1 ...
            path = tmp / f"{name.replace(' ', '_')}.yaml"
            path.write_text(yaml.safe_dump(spec))
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
            "chosen_by": chosen_by[name],
            "paced_share_of_prediction": paced_share(plan, cluster, costs),
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
            f"(x{row['tokens_per_s'] / rows[baseline]['tokens_per_s']:.2f} {baseline})  predicted "
            f"{row['predicted_step_s']:.3f} s ({row['predicted_over_measured'] - 1:+.1%}; "
            f"{row['paced_share_of_prediction']:.0%} of it paced by the emulator)  chosen by {row['chosen_by']}"
        )
    if args.json:
        Path(args.json).write_text(json.dumps({"time_scale": args.time_scale, "rows": rows}, indent=2, default=str))
    return rows


def main() -> None:
    args = arguments(__doc__.splitlines()[0])

    from tessera import DDP
    from tessera.cluster import Cluster
    from tessera.planner.search import search

    costs = profiled_costs(args.time_scale)
    four_spec = calibrate(FOUR, costs.stage_params(0, costs.n_layers))
    two_spec = {**four_spec, "nodes": [four_spec["nodes"][0]]}
    four, two = Cluster.from_dict(four_spec), Cluster.from_dict(two_spec)
    planned = search(four, costs, BATCH, top=1)[0].plan
    plans = {
        "planned": (planned, four, four_spec),
        "uniform": (DDP(), four, four_spec),
        "drop slow": (DDP(), two, two_spec),
    }
    chosen_by = {
        "planned": "tessera.planner.search.search (the cost model)",
        "uniform": "fixed: DDP() on all four",
        "drop slow": "fixed: DDP() on the two fast devices",
    }
    compare(plans, costs, args, baseline="uniform", chosen_by=chosen_by)
    print("EMULATED cluster: speeds 1, 1, 1/2, 1/4 by sleeping (time scale", args.time_scale, ")")


if __name__ == "__main__":
    main()
