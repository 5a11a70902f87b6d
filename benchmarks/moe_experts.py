"""Experts split over ranks (expert parallelism) against experts replicated (DDP, ZeRO-3), and DeepSpeed-MoE, on
the same MoE Llama, in one run: step time and state bytes per rank.

The reference Llama with 8 experts per layer, top-2 (dim 256, 4 layers, expert hidden 512, vocabulary 8,000),
AdamW, 4 × 128 tokens a rank, on 2 and 4 ranks (gloo). Systems: ``tessera-ddp`` (every rank holds every
expert), ``tessera-zero3`` (everything sharded by ZeRO-3), ``tessera-ep`` (``Plan(ep=world)``: each rank holds
8 / world experts, tokens travel by all-to-all; ``tessera-ep-loop`` the same with the experts' products in a
loop instead of one grouped GEMM; ``tessera-ep2-zero3``: ``Plan(ep=2, zero=3)``, experts split over pairs and
sharded over the pairs' replicas, the rest ZeRO-3), ``deepspeed-moe`` (DeepSpeed's MoE layer with the same experts,
``ep_size=world``, dropless, ZeRO-0). State: parameters this rank holds, gradients and optimizer state
(``tessera.memory.model_state_bytes``); step: the slowest rank's median. Each (ranks, system) in fresh
processes, interleaved and rotated per repetition; medians.

    python benchmarks/moe_experts.py [--reps 3] [--steps 5] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

SYSTEMS = ("tessera-ddp", "tessera-zero3", "tessera-ep", "tessera-ep-loop", "tessera-ep2-zero3", "deepspeed-moe")
WORLDS = (2, 4)
DIM, LAYERS, HIDDEN, EXPERTS, TOP_K, VOCAB, SEQ, LOCAL_BATCH = 256, 4, 512, 8, 2, 8000, 128, 4


def _model() -> nn.Module:
    from tessera.models import Llama, LlamaConfig
    from tessera.models.moe import MoESpec

    torch.manual_seed(0)
    moe = MoESpec(experts=EXPERTS, top_k=TOP_K, aux_loss_weight=0.01)
    return Llama(LlamaConfig(vocab_size=VOCAB, dim=DIM, n_layers=LAYERS, n_heads=8, n_kv_heads=4, ffn_dim=HIDDEN,
                             max_seq_len=SEQ, moe=moe))  # fmt: skip


class _DeepSpeedExperts(nn.Module):
    """DeepSpeed's MoE layer in place of a block's feed-forward (its balance loss added to the output's graph
    the way DeepSpeed's users add it to the loss is left out: the step cost is the experts')."""

    def __init__(self, world: int) -> None:
        super().__init__()
        from deepspeed.moe.layer import MoE as DeepSpeedMoE

        from tessera.models.moe import _SwiGLU

        self.moe = DeepSpeedMoE(DIM, _SwiGLU(DIM, HIDDEN), num_experts=EXPERTS, ep_size=world, k=TOP_K,
                                drop_tokens=False, use_rts=False, top2_2nd_expert_sampling=False)  # fmt: skip

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.moe(x)[0]


def _setup(system: str) -> tuple[nn.Module, Any, Any]:
    import torch.distributed as dist

    import tessera

    world = dist.get_world_size()
    model = _model()
    if system.startswith("tessera-"):
        plan = {
            "tessera-ddp": tessera.Plan(),
            "tessera-zero3": tessera.Plan(zero=3),
            "tessera-ep": tessera.Plan(ep=world),
            "tessera-ep-loop": tessera.Plan(ep=world),
            "tessera-ep2-zero3": tessera.Plan(ep=2, zero=3),
        }
        if system == "tessera-ep-loop":  # the experts' products one by one instead of one grouped GEMM
            from tessera.models import moe

            moe.GROUPED = False
        booster = tessera.Booster(plan[system])
        model, optimizer = booster.boost(model, torch.optim.AdamW(model.parameters(), lr=1e-4))
        return model, optimizer, lambda loss: booster.backward(loss, optimizer)
    import deepspeed
    from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer

    deepspeed.init_distributed(dist_backend=dist.get_backend())
    for block in model.layers:
        block.feed_forward = _DeepSpeedExperts(world)
    groups = split_params_into_different_moe_groups_for_optimizer({"params": list(model.parameters()), "name": "p"})
    optimizer = torch.optim.AdamW(groups, lr=1e-4)
    config = {"train_micro_batch_size_per_gpu": LOCAL_BATCH, "zero_optimization": {"stage": 0},
              "zero_allow_untested_optimizer": True}  # fmt: skip
    engine, opt, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    return engine, engine, lambda loss: engine.backward(loss)


def rank_run(system: str, steps: int) -> dict:
    import torch.distributed as dist

    import tessera

    try:
        model, optimizer, backward = _setup(system)
    except Exception as exc:  # a peer that does not run here: say why
        return {"error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}"}
    g = torch.Generator().manual_seed(dist.get_rank())
    tokens = torch.randint(0, VOCAB, (LOCAL_BATCH, SEQ + 1), generator=g)
    times = []
    for _ in range(steps + 1):
        start = time.perf_counter()
        logits = model(tokens[:, :-1])
        backward(F.cross_entropy(logits.float().flatten(0, 1), tokens[:, 1:].flatten()))
        optimizer.step()
        optimizer.zero_grad()
        times.append(time.perf_counter() - start)
    inner = getattr(model, "module", model)
    state = tessera.memory.model_state_bytes(inner, getattr(optimizer, "optimizer", optimizer))
    return {"step_s": statistics.median(times[1:]), "state_bytes": int(state)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    from tessera.testing import run_ranks

    order = [(w, s) for w in WORLDS for s in SYSTEMS]
    runs: dict[str, list[list[dict]]] = {f"{w} {s}": [] for w, s in order}
    for rep in range(args.reps):
        for world, system in order[rep % len(order) :] + order[: rep % len(order)]:
            ranks = run_ranks(rank_run, world, system, args.steps, timeout_s=900)
            runs[f"{world} {system}"].append(ranks)
            shown = ranks[0].get("error") or (f"state {max(r['state_bytes'] for r in ranks) / 2**20:7.1f} MiB, "
                                              f"step {max(r['step_s'] for r in ranks):.3f} s")  # fmt: skip
            print(f"rep {rep} {world} ranks {system:>14}: {shown}", flush=True)
    summary: dict[str, dict] = {}
    for key, reps in runs.items():
        if any("error" in r for ranks in reps for r in ranks):
            summary[key] = {"error": next(r["error"] for ranks in reps for r in ranks if "error" in r)}
            continue
        summary[key] = {
            "state_mib": statistics.median(max(r["state_bytes"] for r in ranks) for ranks in reps) / 2**20,
            "step_s": statistics.median(max(r["step_s"] for r in ranks) for ranks in reps),
        }
    tokens = LOCAL_BATCH * SEQ
    print(f"\n{'ranks':>5} {'system':>14} {'state MiB/rank':>15} {'step s':>7} {'tokens/s':>9}")
    for key, row in summary.items():
        world, system = key.split()
        if "error" in row:
            print(f"{world:>5} {system:>14}  failed: {row['error']}")
            continue
        row["tokens_per_s"] = tokens * int(world) / row["step_s"]
        print(f"{world:>5} {system:>14} {row['state_mib']:15.1f} {row['step_s']:7.3f} {row['tokens_per_s']:9.0f}")
    if args.json:
        args.json.write_text(json.dumps({"summary": summary, "runs": runs}, indent=1))


if __name__ == "__main__":
    main()
