"""Activation memory and step time of each recompute mode, eager and compiled (issue 34, item 4).

One process, one model, every Plan.recompute mode (none, selective, ops, full), each eager and with
``Plan.compile="blocks"``. Memory: the bytes the forward leaves allocated (what it keeps for backward, plus
the logits), summed from the CPU allocator's own events as torch's profiler records them, so the figure
does not come from the recompute code. Time: the median of the timed forward+backward passes, the
configurations' passes interleaved (the first pass of each, with its compilation, is left out).

    python benchmarks/recompute_memory.py [--model demo|30m] [--reps 5] [--threads 2]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile

MODELS = {  # LlamaConfig fields, batch, sequence length
    "demo": ({"vocab_size": 256, "dim": 128, "n_layers": 4, "n_heads": 4, "n_kv_heads": 4, "ffn_dim": 384}, 8, 256),
    "30m": ({"vocab_size": 8192, "dim": 512, "n_layers": 8, "n_heads": 8, "n_kv_heads": 4, "ffn_dim": 1408}, 4, 512),
}
MODES = ("none", "selective", "ops", "full")


def _layout(fields: dict, seq: int, recompute: str, compiled: bool) -> torch.nn.Module:
    """The model as Tessera's runtime lays out one rank's (recompute, then compile): no process group."""
    from tessera.models import Llama, LlamaConfig
    from tessera.parallel.compile import apply_compile
    from tessera.parallel.data_parallel import repeated_blocks
    from tessera.parallel.recompute import apply_recompute

    torch.manual_seed(0)
    model = Llama(LlamaConfig(max_seq_len=seq, **fields))
    blocks = repeated_blocks(model)
    apply_recompute(blocks, recompute)
    apply_compile(blocks, "blocks" if compiled else "none")
    return model


def _kept_bytes(model: torch.nn.Module, x: torch.Tensor) -> tuple[int, torch.Tensor]:
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        logits = model(x)
    return sum(e.self_cpu_memory_usage for e in prof.key_averages()), logits


def _pass(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    start = time.perf_counter()
    F.cross_entropy(model(x).flatten(0, 1).float(), y.flatten()).backward()
    model.zero_grad(set_to_none=True)
    return time.perf_counter() - start


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", choices=sorted(MODELS), default="demo")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    fields, batch, seq = MODELS[args.model]
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, fields["vocab_size"], (batch, seq + 1), generator=g)
    x, y = tokens[:, :-1], tokens[:, 1:]
    configs = {(mode, compiled): _layout(fields, seq, mode, compiled) for compiled in (False, True) for mode in MODES}
    first, kept = {}, {}
    for key, model in configs.items():
        first[key] = _pass(model, x, y)  # eager warm-up, or the compilation
        kept[key], logits = _kept_bytes(model, x)
        del logits
    times: dict[tuple, list[float]] = {key: [] for key in configs}
    for rep in range(args.reps):
        order = list(configs)[rep % len(configs) :] + list(configs)[: rep % len(configs)]
        for key in order:
            times[key].append(_pass(configs[key], x, y))
    n_params = sum(p.numel() for p in configs["none", False].parameters()) / 1e6
    print(f"model {args.model}: {n_params:.1f}M parameters, batch {batch} x seq {seq}, {args.threads} threads, "
          f"torch {torch.__version__}, {args.reps} reps")  # fmt: skip
    print("| recompute | compiled | kept by the forward (MiB) | vs none | fwd+bwd median (s) | vs none | first (s) |")
    print("|---|---|---|---|---|---|---|")
    for mode, compiled in configs:
        key, base = (mode, compiled), ("none", compiled)
        med, base_med = statistics.median(times[key]), statistics.median(times[base])
        row = [mode, "yes" if compiled else "no", f"{kept[key] / 2**20:.1f}", f"{kept[key] / kept[base]:.2f}",
               f"{med:.3f}", f"{med / base_med:.2f}", f"{first[key]:.1f}"]  # fmt: skip
        print("| " + " | ".join(row) + " |")


if __name__ == "__main__":
    main()
