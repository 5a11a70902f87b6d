"""Compiled blocks against eager on this machine (issue 34, item 6): Tessera DDP, ZeRO-3, tp2 and pp2 (1f1b,
4 micro-batches), eager and with ``Plan.compile="blocks"``, beside FSDP2 written by hand (``fully_shard`` per
block and the root, AdamW), eager and with each block's forward compiled. Two gloo ranks, one launch, every
configuration built once and its timed windows interleaved with the others'; medians of the windows' seconds
per step. Every configuration trains on the same global batch: data parallel ones take half each, tp2 and pp2
take all of it.

    python benchmarks/compiled_blocks.py [--model demo|30m] [--windows 5] [--steps 3]

Compile time is measured apart: the first step of each configuration (its compilation, or its eager warm-up).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

PIPELINE = {"microbatches": 4, "schedule": "1f1b"}
MODELS = {  # LlamaConfig fields, batch per data-parallel rank, sequence length
    "demo": ({"vocab_size": 256, "dim": 128, "n_layers": 4, "n_heads": 4, "n_kv_heads": 4, "ffn_dim": 384}, 8, 128),
    "30m": ({"vocab_size": 8192, "dim": 512, "n_layers": 8, "n_heads": 8, "n_kv_heads": 4, "ffn_dim": 1408}, 4, 256),
}


def _model(fields: dict, seq: int) -> torch.nn.Module:
    from tessera.models import Llama, LlamaConfig

    torch.manual_seed(0)
    return Llama(LlamaConfig(max_seq_len=seq, **fields))


def _loss(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1).float(), y.flatten())


def _tessera(fields: dict, seq: int, plan: dict):
    import tessera

    booster = tessera.Booster(tessera.Plan(**plan))
    model = _model(fields, seq)
    model, opt = booster.boost(model, torch.optim.AdamW(model.parameters(), lr=1e-4))
    whole = booster.plan.tp > 1 or booster.plan.pp > 1  # no data parallelism: each rank takes the whole batch

    def step(x: torch.Tensor, y: torch.Tensor) -> float:
        if not whole:
            x, y = _half(x), _half(y)
        if booster.plan.pp > 1:
            loss = booster.execute_pipeline({"x": x, "y": y}, model, _loss, opt)
        else:
            loss = _loss(model(x), y)
            booster.backward(loss, opt)
        opt.step()
        opt.zero_grad()
        return float(booster.reduce_loss(loss.detach()))

    return step


def _half(t: torch.Tensor) -> torch.Tensor:
    """This rank's half of a global batch."""
    return t.chunk(dist.get_world_size())[dist.get_rank()]


def _fsdp_by_hand(fields: dict, seq: int, compiled: bool):
    from torch.distributed.fsdp import fully_shard

    model = _model(fields, seq)
    for block in model.layers:
        if compiled:
            block.forward = torch.compile(block.forward, fullgraph=True)
        fully_shard(block)
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def step(x: torch.Tensor, y: torch.Tensor) -> float:
        loss = _loss(model(_half(x)), _half(y))
        loss.backward()
        opt.step()
        opt.zero_grad()
        mean = loss.detach() / dist.get_world_size()  # the global batch's loss, as Tessera's reduce_loss gives it
        dist.all_reduce(mean)
        return float(mean)

    return step


def measure(model_name: str, windows: int, steps: int) -> dict:
    fields, batch, seq = MODELS[model_name]
    configs = {
        "tessera DDP eager": lambda: _tessera(fields, seq, {}),
        "tessera DDP compiled": lambda: _tessera(fields, seq, {"compile": "blocks"}),
        "tessera ZeRO-3 eager": lambda: _tessera(fields, seq, {"zero": 3}),
        "tessera ZeRO-3 compiled": lambda: _tessera(fields, seq, {"zero": 3, "compile": "blocks"}),
        "tessera tp2 eager": lambda: _tessera(fields, seq, {"tp": 2}),
        "tessera tp2 compiled": lambda: _tessera(fields, seq, {"tp": 2, "compile": "blocks"}),
        "tessera pp2 eager": lambda: _tessera(fields, seq, {"pp": 2, "pipeline": PIPELINE}),
        "tessera pp2 compiled": lambda: _tessera(fields, seq, {"pp": 2, "pipeline": PIPELINE, "compile": "blocks"}),
        "fully_shard by hand eager": lambda: _fsdp_by_hand(fields, seq, False),
        "fully_shard by hand compiled": lambda: _fsdp_by_hand(fields, seq, True),
    }
    g = torch.Generator().manual_seed(0)  # the global batch, the same on every rank
    tokens = torch.randint(0, fields["vocab_size"], (batch * dist.get_world_size(), seq + 1), generator=g)
    x, y = tokens[:, :-1], tokens[:, 1:]
    steps_of, first_s, losses = {}, {}, {}
    for name, make in configs.items():
        steps_of[name] = make()
        dist.barrier()
        started = time.perf_counter()
        steps_of[name](x, y)  # compiles (or warms up)
        first_s[name] = time.perf_counter() - started
    per_step: dict[str, list[float]] = {name: [] for name in configs}
    for _ in range(windows):
        for name, step in steps_of.items():
            dist.barrier()
            started = time.perf_counter()
            for _ in range(steps):
                losses[name] = step(x, y)
            per_step[name].append((time.perf_counter() - started) / steps)
    return {"first_s": first_s, "per_step": per_step, "losses": losses, "tokens": tokens.shape[0] * seq}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", choices=sorted(MODELS), default="demo")
    ap.add_argument("--windows", type=int, default=5)
    ap.add_argument("--steps", type=int, default=3)
    args = ap.parse_args()
    from tessera.testing import run_ranks

    result = run_ranks(measure, 2, args.model, args.windows, args.steps, timeout_s=1800)[0]
    print(f"model {args.model}, 2 gloo ranks, {result['tokens']} tokens a step; median of {args.windows} windows of "
          f"{args.steps} steps, interleaved (torch {torch.__version__})")  # fmt: skip
    print("| configuration | s/step | tokens/s | vs its eager | first step s (compile) | loss after |")
    print("|---|---:|---:|---:|---:|---:|")
    medians = {name: statistics.median(times) for name, times in result["per_step"].items()}
    for name, seconds in medians.items():
        eager = medians[name.replace("compiled", "eager")]
        print(f"| {name} | {seconds:.4f} | {result['tokens'] / seconds:,.0f} | {eager / seconds:.2f}x | "
              f"{result['first_s'][name]:.1f} | {result['losses'][name]:.4f} |")  # fmt: skip
    for layout, peer in (("ZeRO-3 eager", "eager"), ("ZeRO-3 compiled", "compiled")):
        ratio = medians[f"fully_shard by hand {peer}"] / medians[f"tessera {layout}"]
        print(f"tessera {layout} vs fully_shard by hand {peer}: {ratio:.3f}x the speed")


if __name__ == "__main__":
    main()
