"""Tessera's data-parallel family against plain PyTorch and DeepSpeed, in one run.

Model: GPT-2 style (Hugging Face GPT2LMHeadModel from a config), 6 layers,
hidden 384, vocab 8192, sequence 128, batch 4 per rank, fp32, AdamW, 2 ranks
(gloo on CPU, NCCL on CUDA). Systems are interleaved: every repetition runs
each system once, in a rotated order, on freshly built models, so drift of
the machine hits all systems alike. Reported per system: median step time over
repetitions (each repetition's figure is the median of its timed steps); the
bytes of every tensor reachable from the model and optimizer objects on rank 0,
counted after one more, untimed, step (one rule for all systems, so DeepSpeed's
flat fp32 copies count too); and the allocator's peak from building each system
to the end of its second step, which also sees what torch's C++ objects hold
(DDP's buckets) that no Python reference reaches. Ratios are ours / peer; below 1.0 means ours is faster.

    pip install -e '.[bench]'
    python benchmarks/zero_vs_peers.py [--reps 5] [--steps 5] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from typing import Any

os.environ.setdefault("DS_ACCELERATOR", "cpu")  # DeepSpeed reads this at import; CUDA machines override it

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

OURS = ["tessera-ddp", "tessera-zero1", "tessera-zero2", "tessera-zero3"]
TORCH = ["torch-ddp", "torch-ddp+zero-redundancy", "torch-fsdp2-zero2", "torch-fsdp2"]
DEEPSPEED = ["deepspeed-zero1", "deepspeed-zero2", "deepspeed-zero3"]
PAIRS = [
    ("tessera-ddp", "torch-ddp"),
    ("tessera-zero1", "torch-ddp+zero-redundancy"),
    ("tessera-zero2", "torch-fsdp2-zero2"),
    ("tessera-zero3", "torch-fsdp2"),
    ("tessera-zero1", "deepspeed-zero1"),
    ("tessera-zero2", "deepspeed-zero2"),
    ("tessera-zero3", "deepspeed-zero3"),
]
SEQ, VOCAB, LOCAL_BATCH = 128, 8192, 4


def build_model() -> nn.Module:
    from tessera.models import hf

    torch.manual_seed(0)
    return hf.gpt2(n_layer=6, n_embd=384, n_head=6, vocab_size=VOCAB, seq_len=SEQ)


def reachable_bytes(*roots: Any) -> int:
    """Bytes of every distinct tensor storage reachable from ``roots`` (attributes, lists, dicts)."""
    from torch.distributed.tensor import DTensor

    seen_objs: set[int] = set()
    seen_storage: set[tuple[str, int]] = set()
    total = 0
    stack = list(roots)
    while stack:
        obj = stack.pop()
        if id(obj) in seen_objs:
            continue
        seen_objs.add(id(obj))
        if isinstance(obj, torch.Tensor):
            t = obj.to_local() if isinstance(obj, DTensor) else obj
            for extra in ("grad", "ds_tensor"):
                if getattr(obj, extra, None) is not None:
                    stack.append(getattr(obj, extra))
            if t.device.type == "meta":
                continue
            storage = t.untyped_storage()
            key = (str(t.device), storage.data_ptr())
            if storage.nbytes() and key not in seen_storage:
                seen_storage.add(key)
                total += storage.nbytes()
        elif isinstance(obj, dict):
            stack.extend(obj.values())
        elif isinstance(obj, (list, tuple, set)):
            stack.extend(obj)
        elif isinstance(obj, nn.Module):
            stack.extend(vars(obj).values())  # parameters, buffers, submodules, and e.g. an engine's optimizer
        elif hasattr(obj, "__dict__") and type(obj).__module__.split(".")[0] in ("torch", "deepspeed", "tessera"):
            if not isinstance(obj, (torch.distributed.ProcessGroup, type)):
                stack.extend(vars(obj).values())
    return total


def setup(system: str, device: torch.device) -> tuple[nn.Module, Any, Any]:
    """Return (model, optimizer, backward) for ``system``; backward(loss) does the system's backward."""
    import torch.distributed as dist

    model = build_model()
    if system.startswith("tessera-"):
        import tessera

        preset = system.split("-")[1]
        plan = tessera.DDP() if preset == "ddp" else tessera.ZeRO(stage=int(preset[-1]))
        booster = tessera.Booster(plan)
        model, opt = booster.boost(model, torch.optim.AdamW(model.parameters(), lr=1e-4))
        return model, opt, lambda loss: booster.backward(loss, opt)
    if system.startswith("torch-ddp"):
        from torch.distributed.optim import ZeroRedundancyOptimizer
        from torch.nn.parallel import DistributedDataParallel

        model = DistributedDataParallel(model.to(device), device_ids=[device.index] if device.type == "cuda" else None)
        if system.endswith("zero-redundancy"):
            opt = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.AdamW, lr=1e-4)
        else:
            opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        return model, opt, lambda loss: loss.backward()
    if system.startswith("torch-fsdp2"):
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh(device.type, (dist.get_world_size(),))
        reshard = not system.endswith("zero2")
        model.to(device)
        for block in model.transformer.h:
            fully_shard(block, mesh=mesh, reshard_after_forward=reshard)
        fully_shard(model, mesh=mesh, reshard_after_forward=reshard)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        return model, opt, lambda loss: loss.backward()
    if system.startswith("deepspeed-"):
        import deepspeed

        deepspeed.init_distributed(dist_backend=dist.get_backend())
        config = {
            "train_micro_batch_size_per_gpu": LOCAL_BATCH,
            "gradient_accumulation_steps": 1,
            "zero_optimization": {"stage": int(system[-1])},
            "zero_allow_untested_optimizer": True,
            "wall_clock_breakdown": False,
        }
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
        engine, opt, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
        return engine, engine, lambda loss: engine.backward(loss)
    raise ValueError(system)


def _step(model: nn.Module, opt: Any, backward: Any, tokens: torch.Tensor) -> None:
    logits = model(tokens[:, :-1]).logits
    loss = F.cross_entropy(logits.float().flatten(0, 1), tokens[:, 1:].flatten())
    backward(loss)
    opt.step()


def run_system(system: str, steps: int, warmup: int, device: torch.device) -> tuple[float, int]:
    """(median seconds of the timed steps, bytes reachable from model and optimizer): the state is
    counted after one more, untimed, step (gradients and optimizer state alive), not inside a timed one."""
    import torch.distributed as dist

    model, opt, backward = setup(system, device)
    g = torch.Generator().manual_seed(dist.get_rank())
    tokens = torch.randint(0, VOCAB, (LOCAL_BATCH, SEQ + 1), generator=g).to(device)
    times = []
    for step in range(warmup + steps):
        if device.type == "cuda":
            torch.cuda.synchronize()
        dist.barrier()
        start = time.perf_counter()
        _step(model, opt, backward, tokens)
        opt.zero_grad()
        if device.type == "cuda":
            torch.cuda.synchronize()
        if step >= warmup:
            times.append(time.perf_counter() - start)
    _step(model, opt, backward, tokens)  # untimed: the peak state, counted outside the timed steps
    state = reachable_bytes(model, opt)
    opt.zero_grad()
    del model, opt
    return statistics.median(times), state


def allocator_peak(system: str, device: torch.device) -> int:
    """Peak bytes the tensor allocator held from building the system to the end of its second step.

    Allocator-level, so what torch's C++ objects hold (DDP's gradient buckets, FSDP's flat
    buffers, DeepSpeed's partitions and staging copies) counts as well as what Python reaches:
    CUDA's max allocated on a GPU, the profiler's record of every allocation on CPU."""
    import torch.distributed as dist

    from tessera.memory import peak_tensor_bytes

    dist.barrier()
    g = torch.Generator().manual_seed(dist.get_rank())
    tokens = torch.randint(0, VOCAB, (LOCAL_BATCH, SEQ + 1), generator=g).to(device)
    with peak_tensor_bytes(device, live_before=0) as peak:
        model, opt, backward = setup(system, device)
        for _ in range(2):
            _step(model, opt, backward, tokens)
            opt.zero_grad()
    del model, opt
    return peak[0]


def rank_main(systems: list[str], reps: int, steps: int, warmup: int) -> dict[str, Any]:
    import torch.distributed as dist

    from tessera.distributed import pick_device

    device = pick_device("auto")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    times: dict[str, list[float]] = {s: [] for s in systems}
    state: dict[str, int] = {}
    allocated = {system: allocator_peak(system, device) for system in systems}  # once each, before timing
    for rep in range(reps):
        order = systems[rep % len(systems) :] + systems[: rep % len(systems)]
        for system in order:
            t, b = run_system(system, steps, warmup, device)
            times[system].append(t)
            state[system] = b
            if dist.get_rank() == 0:
                print(f"  rep {rep + 1}/{reps} {system:28s} {t * 1e3:8.1f} ms/step", flush=True)
    return {
        "times": times,
        "state_bytes": state,
        "allocator_peak_bytes": allocated,
        "device": str(device),
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
    }


def report(result: dict[str, Any], world: int) -> dict[str, Any]:
    med = {s: statistics.median(t) for s, t in result["times"].items()}
    rows = [
        {
            "system": s,
            "median_step_ms": med[s] * 1e3,
            "state_mib_rank0": result["state_bytes"][s] / 2**20,
            "allocator_peak_mib_rank0": result["allocator_peak_bytes"][s] / 2**20,
            "reps_ms": [t * 1e3 for t in result["times"][s]],
        }
        for s in med
    ]
    ratios = [
        {
            "ours": a,
            "peer": b,
            "time_ratio": med[a] / med[b],
            "state_ratio": result["state_bytes"][a] / result["state_bytes"][b],
            "allocator_peak_ratio": result["allocator_peak_bytes"][a] / result["allocator_peak_bytes"][b],
        }
        for a, b in PAIRS
        if a in med and b in med
    ]
    print(
        f"\nGPT-2 6L/384/vocab {VOCAB}, seq {SEQ}, batch {LOCAL_BATCH}/rank, {world} ranks, "
        f"fp32, device {result['device_name']}, torch {torch.__version__}"
    )
    print(f"{'system':30s} {'median ms/step':>15s} {'state MiB (rank 0)':>19s} {'allocator peak MiB':>19s}")
    for r in rows:
        print(
            f"{r['system']:30s} {r['median_step_ms']:15.1f} {r['state_mib_rank0']:19.2f} "
            f"{r['allocator_peak_mib_rank0']:19.2f}"
        )
    print(f"\n{'ours / peer':55s} {'time':>7s} {'state':>7s} {'alloc':>7s}")
    for r in ratios:
        print(
            f"{r['ours'] + ' / ' + r['peer']:55s} {r['time_ratio']:7.3f} {r['state_ratio']:7.3f} "
            f"{r['allocator_peak_ratio']:7.3f}"
        )
    return {
        "model": "gpt2-6L-384h-8192v",
        "seq": SEQ,
        "local_batch": LOCAL_BATCH,
        "world_size": world,
        "device": result["device_name"],
        "torch": torch.__version__,
        "systems": rows,
        "ratios": ratios,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--steps", type=int, default=5, help="timed steps per repetition")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--systems", default="all", help="comma-separated subset, or 'all'")
    ap.add_argument("--json", help="also write the results to this file")
    args = ap.parse_args()
    systems = OURS + TORCH + DEEPSPEED if args.systems == "all" else args.systems.split(",")
    try:
        import deepspeed  # noqa: F401
    except ImportError:
        print("DeepSpeed is not installed (pip install -e '.[bench]'): running without it", file=sys.stderr)
        systems = [s for s in systems if not s.startswith("deepspeed")]
    from tessera.testing import run_ranks

    result = run_ranks(rank_main, args.world, systems, args.reps, args.steps, args.warmup, timeout_s=3600)[0]
    out = report(result, args.world)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
