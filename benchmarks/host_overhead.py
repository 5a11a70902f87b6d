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
  block's forward before ``fully_shard``; Tessera: ``Plan(compile="blocks")``), compared with each other;
- ``..., a second copy``: fully_shard by hand built again, timed as another configuration: how far two copies
  of identical code land apart on this machine, the floor under any ratio here.

Each window's time is divided by the same window's baseline (adjacent in time, so slow drift of the machine
cancels), and the median and quartiles of those ratios are reported.

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
    "fully_shard by hand, a second copy": (_by_hand, False),  # the noise floor: same code, built twice
    "tessera ZeRO-3": (_tessera, True),
    "tessera ZeRO-3, no traffic count": (_tessera, False),
    "fully_shard by hand, compiled": (lambda: _by_hand(compiled=True), False),
    "fully_shard by hand, compiled, a second copy": (lambda: _by_hand(compiled=True), False),
    "tessera ZeRO-3, compiled": (lambda: _tessera(compiled=True), True),
}
BASELINE = {name: "fully_shard by hand, compiled" if "compiled" in name else "fully_shard by hand" for name in CONFIGS}


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
    per_step = result["per_step"]
    shape = f"{FIELDS['n_layers']} blocks of dim {FIELDS['dim']}, batch {BATCH} x {SEQ}"
    print(f"{args.ranks} gloo rank(s), {shape}; {args.windows} windows of {args.steps} steps, interleaved "
          f"(torch {torch.__version__})")  # fmt: skip
    print("ratio: each window's time over the same window's fully_shard by hand (eager or compiled, as it is),")
    print("median and quartiles over the windows; the second copies show the spread of identical code")
    print("| configuration | median ms/step | time ratio, median | quartiles |")
    print("|---|---:|---:|---|")
    for name, times in per_step.items():
        ratios = sorted(t / b for t, b in zip(times, per_step[BASELINE[name]]))
        q1, _, q3 = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else (ratios[0],) * 3
        print(f"| {name} | {statistics.median(times) * 1e3:.2f} | {statistics.median(ratios):.3f}x | "
              f"{q1:.3f}–{q3:.3f} |")  # fmt: skip
    if result["profile"]:
        print(result["profile"])


if __name__ == "__main__":
    main()
