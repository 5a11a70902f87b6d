"""What Tessera adds on the host over the FSDP2 it wraps (issue 34, item 3).

A deep, narrow Llama (16 blocks of dim 64, a batch of 2 × 16 tokens) makes every step host-bound: its kernels
take microseconds, so a step's time is the Python and dispatch work around them, which is what an H100 waits on
when the host falls behind. Each configuration trains the same model on the same tokens on gloo ranks, built
once; timed windows are interleaved; medians of the windows' seconds per step.

- ``fully_shard by hand``: ``fully_shard`` per block and on the root, ``AdamW``, ``loss.backward()``;
- ``tessera ZeRO-3``: ``Booster(Plan(zero=3))``, ``booster.backward``, the boosted optimizer;
- ``tessera ZeRO-3, no traffic count``: the same with the collective counter's kernels removed, to show its
  share;
- ``... compiled``: the first two with every block's forward compiled (by hand: ``torch.compile`` of each
  block's forward before ``fully_shard``; Tessera: ``Plan(compile="blocks")``), compared with each other.

``--profile NAME`` prints cProfile's top functions for one configuration's steps.

    python benchmarks/host_overhead.py [--ranks 1] [--windows 7] [--steps 20] [--profile "tessera ZeRO-3"]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

FIELDS = {"vocab_size": 256, "dim": 64, "n_layers": 16, "n_heads": 4, "n_kv_heads": 2, "ffn_dim": 128}
BATCH, SEQ = 2, 16


def _model() -> torch.nn.Module:
    from tessera.models import Llama, LlamaConfig

    torch.manual_seed(0)
    return Llama(LlamaConfig(max_seq_len=SEQ, **FIELDS))


def _loss(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1).float(), y.flatten())


def _tessera(compiled: bool = False):
    import tessera

    booster = tessera.Booster(tessera.Plan(zero=3, compile="blocks" if compiled else "none"))
    model = _model()
    model, opt = booster.boost(model, torch.optim.AdamW(model.parameters(), lr=1e-4))

    def step(x: torch.Tensor, y: torch.Tensor) -> None:
        booster.backward(_loss(model(x), y), opt)
        opt.step()
        opt.zero_grad()

    return step


def _by_hand(compiled: bool = False):
    from torch.distributed.fsdp import fully_shard

    model = _model()
    for block in model.layers:
        if compiled:
            block.forward = torch.compile(block.forward, fullgraph=True)
        fully_shard(block)
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def step(x: torch.Tensor, y: torch.Tensor) -> None:
        _loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()

    return step


def _counting(on: bool) -> None:
    """The collective counter's kernels in place (as Tessera installs them) or removed."""
    from tessera import traffic

    if on:
        traffic.install()
    else:
        for library in traffic._LIBRARIES:
            library._destroy()
        traffic._LIBRARIES.clear()


CONFIGS = {  # name -> (build, traffic counter on while it runs)
    "fully_shard by hand": (_by_hand, False),
    "tessera ZeRO-3": (_tessera, True),
    "tessera ZeRO-3, no traffic count": (_tessera, False),
    "fully_shard by hand, compiled": (lambda: _by_hand(compiled=True), False),
    "tessera ZeRO-3, compiled": (lambda: _tessera(compiled=True), True),
}
BASELINE = {"fully_shard by hand": "fully_shard by hand", "tessera ZeRO-3": "fully_shard by hand",
            "tessera ZeRO-3, no traffic count": "fully_shard by hand",
            "fully_shard by hand, compiled": "fully_shard by hand, compiled",
            "tessera ZeRO-3, compiled": "fully_shard by hand, compiled"}  # fmt: skip


def measure(windows: int, steps: int, profiled: str | None) -> dict:
    g = torch.Generator().manual_seed(dist.get_rank())
    tokens = torch.randint(0, FIELDS["vocab_size"], (BATCH, SEQ + 1), generator=g)
    x, y = tokens[:, :-1], tokens[:, 1:]
    built = {}
    for name, (build, counted) in CONFIGS.items():
        _counting(counted)
        built[name] = build()
        built[name](x, y)  # warm-up (and compilation)
        built[name](x, y)
    per_step: dict[str, list[float]] = {name: [] for name in CONFIGS}
    for window in range(windows):
        names = list(CONFIGS)[window % len(CONFIGS) :] + list(CONFIGS)[: window % len(CONFIGS)]
        for name in names:
            _counting(CONFIGS[name][1])
            dist.barrier()
            started = time.perf_counter()
            for _ in range(steps):
                built[name](x, y)
            per_step[name].append((time.perf_counter() - started) / steps)
    profile = None
    if profiled is not None and dist.get_rank() == 0:
        _counting(CONFIGS[profiled][1])
        profiler = cProfile.Profile()
        profiler.enable()
        for _ in range(steps):
            built[profiled](x, y)
        profiler.disable()
        out = io.StringIO()
        pstats.Stats(profiler, stream=out).sort_stats("tottime").print_stats(25)
        profile = out.getvalue()
    return {"per_step": per_step, "profile": profile}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, default=1)
    ap.add_argument("--windows", type=int, default=7)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--profile", choices=sorted(CONFIGS))
    args = ap.parse_args()
    from tessera.testing import run_ranks

    result = run_ranks(measure, args.ranks, args.windows, args.steps, args.profile, timeout_s=1800)[0]
    medians = {name: statistics.median(times) for name, times in result["per_step"].items()}
    shape = f"{FIELDS['n_layers']} blocks of dim {FIELDS['dim']}, batch {BATCH} x {SEQ}"
    print(f"{args.ranks} gloo rank(s), {shape}; median of {args.windows} windows of {args.steps} steps, "
          f"interleaved (torch {torch.__version__})")  # fmt: skip
    print("| configuration | ms/step | vs fully_shard by hand (eager or compiled, as it is) |")
    print("|---|---:|---:|")
    for name, seconds in medians.items():
        print(f"| {name} | {seconds * 1e3:.2f} | {seconds / medians[BASELINE[name]]:.3f}x the time |")
    if result["profile"]:
        print(result["profile"])


if __name__ == "__main__":
    main()
