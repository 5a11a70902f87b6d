"""Loading a pretrained checkpoint into a layout: Tessera's slices against every rank loading it whole.

A Hugging Face Llama (default ~207 M parameters: hidden 1024, 12 layers, vocabulary 32,000, untied) is
saved once with ``save_pretrained`` in bf16 (as checkpoints are shipped), in 100 MB files. Then, on 4
ranks, for each layout (DDP, ZeRO-3, dp2 × tp2):

- ``tessera``: ``model.pretrained``'s path: parameters on meta, the Booster lays the model out and each
  rank reads only the slices it holds (fp32);
- ``whole``: what a user does without it: ``AutoModelForCausalLM.from_pretrained`` on every rank (fp32),
  then the same Booster.

Each (layout, way) runs in fresh processes, interleaved, rotated every repetition. Per rank: seconds from
building the model to the boosted model being ready, and the peak resident memory above what the rank held
before building (the kernel's high-water mark, VmHWM, reset just before, minus the resident size then).
Reported: the medians over repetitions of the slowest rank's seconds and the largest rank's peak.

    python benchmarks/pretrained_loading.py [--reps 3] [--layers 12] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import tempfile
import time
from pathlib import Path

import torch

LAYOUTS = {"ddp": {"zero": 0}, "zero3": {"zero": 3}, "dp2 x tp2": {"tp": 2}}
WAYS = ("tessera", "whole")
WORLD = 4


def save_model(path: Path, layers: int, hidden: int, vocab: int) -> int:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=hidden * 11 // 4, num_hidden_layers=layers,
        num_attention_heads=16, num_key_value_heads=8, max_position_embeddings=512, tie_word_embeddings=False,
    )  # fmt: skip
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(str(path), max_shard_size="100MB")
    return sum(p.numel() for p in model.parameters())


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


def _reset_peak() -> None:
    """Start the kernel's high-water mark of resident memory (VmHWM) from now: ``ru_maxrss`` would carry
    the launching process's peak (Linux keeps it across fork and exec)."""
    Path("/proc/self/clear_refs").write_text("5")


def _peak_bytes() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


def rank_load(path: str, layout: dict, way: str) -> dict:
    """On one rank (inside run_ranks): build, lay out and load; time and memory."""
    import tessera
    from tessera.models.pretrained import empty_pretrained

    _reset_peak()
    before = _rss_bytes()
    start = time.perf_counter()
    if way == "tessera":
        model = empty_pretrained(path)
    else:
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    booster = tessera.Booster(tessera.Plan(**layout))
    model, _ = booster.boost(model)
    seconds = time.perf_counter() - start
    peak = _peak_bytes()
    local = [p.to_local() if hasattr(p, "to_local") else p for p in model.parameters()]
    held = sum(t.numel() * t.element_size() for t in local)  # as loaded: fp32 in both ways
    return {"seconds": seconds, "peak_bytes": peak - before, "held_bytes": held}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    from tessera.testing import run_ranks

    runs: dict[str, list[list[dict]]] = {f"{name} {way}": [] for name in LAYOUTS for way in WAYS}
    with tempfile.TemporaryDirectory(prefix="tessera-pretrained-") as tmp:
        path = Path(tmp) / "llama"
        n_params = save_model(path, args.layers, args.hidden, args.vocab)
        files = sorted(path.glob("*.safetensors"))
        print(f"{n_params / 1e6:.0f} M parameters, {len(files)} files, "
              f"{sum(f.stat().st_size for f in files) / 1e6:.0f} MB (bf16); {WORLD} ranks")  # fmt: skip
        for rep in range(args.reps):
            order = [(name, way) for name in LAYOUTS for way in WAYS]
            order = order[rep % len(order) :] + order[: rep % len(order)]
            for name, way in order:
                ranks = run_ranks(rank_load, WORLD, str(path), LAYOUTS[name], way, timeout_s=900)
                runs[f"{name} {way}"].append(ranks)
                slowest, largest = max(r["seconds"] for r in ranks), max(r["peak_bytes"] for r in ranks)
                print(f"rep {rep} {name:>10} {way:>7}: {slowest:6.2f} s, peak +{largest / 2**20:7.0f} MiB", flush=True)
    summary = {}
    for name in LAYOUTS:
        for way in WAYS:
            reps = runs[f"{name} {way}"]
            summary[f"{name} {way}"] = {
                "seconds": statistics.median(max(r["seconds"] for r in ranks) for ranks in reps),
                "peak_mib": statistics.median(max(r["peak_bytes"] for r in ranks) for ranks in reps) / 2**20,
                "held_mib": max(r["held_bytes"] for r in reps[0]) / 2**20,
            }
    print(f"\n{'layout':>10} {'way':>8} {'s (slowest rank)':>17} {'peak MiB':>9} {'held MiB':>9}")
    for key, row in summary.items():
        name, way = key.rsplit(" ", 1)
        print(f"{name:>10} {way:>8} {row['seconds']:17.2f} {row['peak_mib']:9.0f} {row['held_mib']:9.0f}")
    for name in LAYOUTS:
        ours, whole = summary[f"{name} tessera"], summary[f"{name} whole"]
        print(f"{name}: peak {ours['peak_mib'] / whole['peak_mib']:.2f}x of loading whole, "
              f"time {ours['seconds'] / whole['seconds']:.2f}x")  # fmt: skip
    if args.json:
        args.json.write_text(json.dumps({"params": n_params, "summary": summary, "runs": runs}, indent=1))


if __name__ == "__main__":
    main()
