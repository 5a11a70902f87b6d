"""Pipeline schedules' bubbles and activation memory, and tokens/s of hybrid layouts vs plain DDP.

Part 1 (bubbles): pp=4 on 4 ranks, the reference Llama with 8 layers, run through
``Booster.execute_pipeline``. Every layer's compute is stretched by sleeping, so the
measurement is about the schedule, not about how many CPU cores the machine has: per layer
and micro-batch the forward sleeps F, the input-gradient backward F and the weight-gradient
backward F (B = 2F in total, split F + F for zero-bubble schedules). A rank's busy time is
the sum of its sleeps; its idle fraction is 1 - busy / step time. The textbook fraction is
next to it (p ranks, m micro-batches, v stages per rank):

    GPipe, 1F1B              (p-1) / (m + p-1)
    interleaved 1F1B         (p-1) / (v m + p-1)
    interleaved zero bubble  (p-1) / (3 v m + p-1)      (ZB-H1: only F+B-W of each warm-up is idle)
    ZBV zero bubble          0 when m >= 2p and F = B = W

Peak activation memory per rank is the peak of live bytes saved for backward
(``saved_tensors_hooks``, parameters and buffers excluded), the part a schedule changes, per
step; "left after step" is what a step's saved tensors leave alive afterwards (should be 0).

Part 2 (tokens/s): the foundation benchmark's 6-layer GPT-2 (Hugging Face, hidden 384, 6 heads,
vocab 8192, sequence 128) under tp2, pp2 (1F1B, 4 micro-batches), dp2 and tp2×pp2, each against
the same model on torch DDP with the same number of ranks, interleaved in one process group.

    python benchmarks/pipeline_bubbles.py [--part all|bubbles|throughput] [--reps 3] [--sleep-ms 10] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

SCHEDULES = ["gpipe", "1f1b", "interleaved_1f1b", "interleaved_zero_bubble", "zbv_zero_bubble"]
MICROBATCHES = [4, 8, 16]
PP, LAYERS, SEQ = 4, 8, 16


def textbook_bubble(schedule: str, p: int, m: int) -> float:
    v = 1 if schedule in ("gpipe", "1f1b") else 2
    if schedule == "zbv_zero_bubble":
        return 0.0 if m >= 2 * p else float("nan")
    if schedule == "interleaved_zero_bubble":
        return (p - 1) / (3 * v * m + p - 1)
    return (p - 1) / (v * m + p - 1)


# ------------------------------------------------------------------ stretched compute
class _Clock:
    busy = 0.0

    @classmethod
    def sleep(cls, seconds: float) -> None:
        start = time.perf_counter()
        time.sleep(seconds)
        cls.busy += time.perf_counter() - start


class _SleepInBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, seconds: float) -> torch.Tensor:
        ctx.seconds = seconds
        return x.clone()  # not a view: pipelining detaches stage outputs in place

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        _Clock.sleep(ctx.seconds)
        return grad, None


class _WeightGradSleep(nn.Module):
    """A parametrization: the weight passes through a sleep that runs when its gradient is computed."""

    def __init__(self, seconds: float) -> None:
        super().__init__()
        self.seconds = seconds

    def forward(self, weight: torch.Tensor) -> torch.Tensor:
        return _SleepInBackward.apply(weight, self.seconds)


def stretch(model: nn.Module, seconds: float) -> None:
    """Forward F, input-gradient F and weight-gradient F of sleep per block and micro-batch."""
    from torch.nn.utils import parametrize

    for block in model.layers:
        block.register_forward_pre_hook(lambda m, args: _Clock.sleep(seconds))
        block.register_forward_hook(lambda m, args, out: _SleepInBackward.apply(out, seconds))
        parametrize.register_parametrization(block.feed_forward.w2, "weight", _WeightGradSleep(seconds))


def bubble_worker(sleep_s: float, reps: int) -> list[dict]:
    import torch.distributed as dist

    import tessera
    from tessera.memory import SavedBytes
    from tessera.models import Llama, LlamaConfig

    out = []
    for schedule in SCHEDULES:
        for mb in MICROBATCHES:
            torch.manual_seed(0)
            model = Llama(LlamaConfig(vocab_size=64, dim=32, n_layers=LAYERS, n_heads=4, n_kv_heads=2, max_seq_len=SEQ))
            stretch(model, sleep_s)
            booster = tessera.Booster(tessera.Hybrid(pp=PP, microbatches=mb, schedule=schedule))
            model, opt = booster.boost(model, torch.optim.AdamW(model.parameters()))
            x = torch.randint(0, 64, (mb, SEQ + 1))
            batch = (x[:, :-1], x[:, 1:])

            def loss_fn(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
                return F.cross_entropy(logits.flatten(0, 1), y.flatten())

            booster.execute_pipeline(batch, model, loss_fn, opt)  # warm-up (shape inference)
            opt.zero_grad()
            idle, walls = [], []
            # Weights and rotary tables that autograd saves cost nothing extra.
            saved = SavedBytes(exclude=[*model.parameters(), *(b for st in model.stage_modules for b in st.buffers())])
            peaks = []
            for _ in range(reps):
                dist.barrier()
                _Clock.busy = 0.0
                before = saved.peak = saved.live  # a step's own peak, above what earlier steps left
                start = time.perf_counter()
                with saved.track():
                    booster.execute_pipeline(batch, model, loss_fn, opt)
                wall = time.perf_counter() - start
                opt.zero_grad()
                walls.append(wall)
                idle.append(1 - _Clock.busy / wall)
                peaks.append(saved.peak - before)
            out.append(
                {
                    "schedule": schedule,
                    "microbatches": mb,
                    "rank": dist.get_rank(),
                    "idle": statistics.median(idle),
                    "step_s": statistics.median(walls),
                    "peak_saved_bytes": max(peaks),
                    "left_per_step_bytes": saved.live // reps,  # saved tensors never freed (should be 0)
                }
            )
    return out


# ---------------------------------------------------------------- tokens/s vs DDP
HF = {"n_layer": 6, "n_embd": 384, "n_head": 6, "vocab_size": 8192, "seq_len": 128}
GLOBAL_BATCH = 16


def _model() -> nn.Module:
    from tessera.models import hf

    torch.manual_seed(0)
    return hf.gpt2(**HF)


def _loss(output: Any, y: torch.Tensor) -> torch.Tensor:
    logits = output.logits if hasattr(output, "logits") else output
    return F.cross_entropy(logits.float().flatten(0, 1), y.flatten())


def throughput_worker(layouts: list[str], reps: int, steps: int) -> dict[str, float] | None:
    """Tokens/s of each layout (median over interleaved repetitions); rank 0 returns them."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    import tessera

    world = dist.get_world_size()
    g = torch.Generator().manual_seed(0)
    data = torch.randint(0, HF["vocab_size"], (GLOBAL_BATCH, HF["seq_len"] + 1), generator=g)

    def tessera_step(plan: tessera.Plan):
        booster = tessera.Booster(plan)
        model = _model()
        model, opt = booster.boost(model, torch.optim.AdamW(model.parameters()))
        rows = GLOBAL_BATCH // booster.plan.dp
        mine = data[booster.dp_rank * rows : (booster.dp_rank + 1) * rows]
        batch = (mine[:, :-1].to(booster.device), mine[:, 1:].to(booster.device))

        def step() -> None:
            booster.execute_pipeline(batch, model, _loss, opt)
            opt.step()
            opt.zero_grad()

        return step

    def ddp_step():
        model = DistributedDataParallel(_model())
        opt = torch.optim.AdamW(model.parameters())
        rows = GLOBAL_BATCH // world
        mine = data[dist.get_rank() * rows : (dist.get_rank() + 1) * rows]

        def step() -> None:
            _loss(model(mine[:, :-1]), mine[:, 1:]).backward()
            opt.step()
            opt.zero_grad()

        return step

    plans = {
        "tp2": tessera.Hybrid(tp=2),
        "pp2": tessera.Hybrid(pp=2, microbatches=4, schedule="1f1b"),
        "dp2": tessera.DDP(),
        "tp2xpp2": tessera.Hybrid(tp=2, pp=2, microbatches=4, schedule="1f1b"),
    }
    steppers = {name: tessera_step(plans[name]) if name != "torch-ddp" else ddp_step() for name in layouts}
    times: dict[str, list[float]] = {name: [] for name in layouts}
    for name in layouts:
        steppers[name]()  # warm-up
    for rep in range(reps):
        order = layouts[rep % len(layouts) :] + layouts[: rep % len(layouts)]
        for name in order:
            dist.barrier()
            start = time.perf_counter()
            for _ in range(steps):
                steppers[name]()
            dist.barrier()
            times[name].append((time.perf_counter() - start) / steps)
    tokens = GLOBAL_BATCH * HF["seq_len"]
    return {name: tokens / statistics.median(t) for name, t in times.items()} if dist.get_rank() == 0 else None


def main() -> None:
    from tessera.testing import run_ranks

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--sleep-ms", type=float, default=10.0)
    parser.add_argument("--json", default=None)
    parser.add_argument("--part", choices=["all", "bubbles", "throughput"], default="all")
    args = parser.parse_args()
    os.environ.setdefault("TESSERA_DEVICE", "cpu")

    table: list[dict] = []
    if args.part in ("all", "bubbles"):
        rows = [
            r for rank in run_ranks(bubble_worker, PP, args.sleep_ms / 1e3, args.reps, timeout_s=1800) for r in rank
        ]
        print(f"\npp={PP}, {LAYERS} layers, F=B=W={args.sleep_ms:g} ms per layer and micro-batch (sleep)")
        header = f"{'schedule':24} {'mb':>3} {'textbook':>9} {'idle per rank':>30} {'step s':>7}"
        print(f"{header} {'peak saved KiB per rank':>32} {'left after step KiB':>24}")
        for schedule in SCHEDULES:
            for mb in MICROBATCHES:
                mine = sorted(
                    (r for r in rows if r["schedule"] == schedule and r["microbatches"] == mb), key=lambda r: r["rank"]
                )
                idle = [r["idle"] for r in mine]
                peak = [r["peak_saved_bytes"] // 1024 for r in mine]
                left = [r["left_per_step_bytes"] // 1024 for r in mine]
                book = textbook_bubble(schedule, PP, mb)
                table.append(
                    {
                        "schedule": schedule,
                        "microbatches": mb,
                        "textbook": book,
                        "idle": idle,
                        "step_s": max(r["step_s"] for r in mine),
                        "peak_saved_kib": peak,
                        "left_per_step_kib": left,
                    }
                )
                print(
                    f"{schedule:24} {mb:>3} {book:>9.3f} {' '.join(f'{x:.3f}' for x in idle):>30} "
                    f"{table[-1]['step_s']:>7.3f} {' '.join(map(str, peak)):>32} {' '.join(map(str, left)):>24}"
                )

    throughput = {}
    for world, layouts in ((2, ["torch-ddp", "tp2", "pp2", "dp2"]), (4, ["torch-ddp", "tp2xpp2"])):
        if args.part not in ("all", "throughput"):
            break
        got = run_ranks(throughput_worker, world, layouts, args.reps, args.steps, timeout_s=1800)[0]
        throughput[world] = got
        print(f"\n{world} ranks, tokens/s (median of {args.reps} interleaved reps of {args.steps} steps)")
        for name in layouts:
            ratio = got[name] / got["torch-ddp"]
            print(f"  {name:10} {got[name]:9.0f}   tokens/s ratio to torch DDP {ratio:.2f} (above 1: faster)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"bubbles": table, "throughput": throughput, "args": vars(args)}, f, indent=2)


if __name__ == "__main__":
    main()
