"""State bytes per rank and step time: full fine-tuning against LoRA (peft), under DDP and ZeRO-3, in one run.

A Hugging Face Llama (default: hidden 512, 8 layers, vocabulary 8,000: 29 M parameters) on 4 ranks,
AdamW, batch 4 × 128 a rank. ``full``: every parameter trains; ``lora``: peft adapters of rank 8 on
q_proj and v_proj, the optimizer over the adapters alone. Per rank after the timed steps:
``tessera.memory.model_state_bytes`` (parameters this rank holds, their gradients and the optimizer's
state). Each (layout, way) in fresh processes, interleaved and rotated per repetition; medians.

    python benchmarks/lora_state.py [--reps 3] [--steps 5] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

LAYOUTS = {"ddp": {"zero": 0}, "zero3": {"zero": 3}}
WAYS = ("full", "lora")
WORLD, SEQ, LOCAL_BATCH = 4, 128, 4


def rank_run(layout: dict, way: str, steps: int, hidden: int, layers: int, vocab: int) -> dict:
    import torch.nn.functional as F

    import tessera
    from tessera.models import hf
    from tessera.models.lora import with_lora

    torch.manual_seed(0)
    model = hf.llama(n_layer=layers, hidden=hidden, n_head=8, n_kv_head=4, ffn=hidden * 11 // 4, vocab_size=vocab,
                     seq_len=SEQ)  # fmt: skip
    if way == "lora":
        model = with_lora(model, r=8, alpha=16)
    trainable = [p for p in model.parameters() if p.requires_grad]
    booster = tessera.Booster(tessera.Plan(**layout))
    model, optimizer = booster.boost(model, torch.optim.AdamW(trainable, lr=1e-4))
    x = torch.randint(0, vocab, (LOCAL_BATCH, SEQ + 1), generator=torch.Generator().manual_seed(1))

    def loss_fn(out, y):
        return F.cross_entropy(out.logits.flatten(0, 1), y.flatten())

    times = []
    for _ in range(steps + 1):
        start = time.perf_counter()
        booster.execute_pipeline((x[:, :-1], x[:, 1:]), model, loss_fn, optimizer)
        optimizer.step()
        optimizer.zero_grad(set_to_none=False)  # the gradients' memory counts as held
        times.append(time.perf_counter() - start)
    return {"state_bytes": int(tessera.memory.model_state_bytes(model, optimizer)),
            "step_s": statistics.median(times[1:]), "trainable": sum(p.numel() for p in trainable)}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=8000)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    from tessera.testing import run_ranks

    runs: dict[str, list[list[dict]]] = {f"{n} {w}": [] for n in LAYOUTS for w in WAYS}
    order = [(n, w) for n in LAYOUTS for w in WAYS]
    for rep in range(args.reps):
        for name, way in order[rep % len(order) :] + order[: rep % len(order)]:
            ranks = run_ranks(rank_run, WORLD, LAYOUTS[name], way, args.steps, args.hidden, args.layers, args.vocab,
                              timeout_s=900)  # fmt: skip
            runs[f"{name} {way}"].append(ranks)
            print(f"rep {rep} {name:>5} {way:>4}: state {max(r['state_bytes'] for r in ranks) / 2**20:8.1f} MiB, "
                  f"step {max(r['step_s'] for r in ranks):.3f} s", flush=True)  # fmt: skip
    summary = {
        key: {
            "state_mib": statistics.median(max(r["state_bytes"] for r in ranks) for ranks in reps) / 2**20,
            "step_s": statistics.median(max(r["step_s"] for r in ranks) for ranks in reps),
            "trainable": reps[0][0]["trainable"],
        }
        for key, reps in runs.items()
    }
    print(f"\n{'layout':>6} {'way':>5} {'trainable':>11} {'state MiB/rank':>15} {'step s':>7}")
    for key, row in summary.items():
        name, way = key.split()
        print(f"{name:>6} {way:>5} {row['trainable']:>11,} {row['state_mib']:15.1f} {row['step_s']:7.3f}")
    for name in LAYOUTS:
        full, lora = summary[f"{name} full"], summary[f"{name} lora"]
        print(f"{name}: LoRA state {lora['state_mib'] / full['state_mib']:.2f}x of full, "
              f"step {lora['step_s'] / full['step_s']:.2f}x")  # fmt: skip
    if args.json:
        args.json.write_text(json.dumps({"summary": summary, "runs": runs}, indent=1))


if __name__ == "__main__":
    main()
