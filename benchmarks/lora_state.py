"""State bytes per rank, checkpoint bytes and step time: full fine-tuning against LoRA (peft), under DDP, ZeRO-3
and dp2 × tp2, in one run.

A Hugging Face Llama (default: hidden 512, 8 layers, vocabulary 8,000: 29 M parameters) on 4 ranks,
AdamW, batch 4 × 128 a rank. ``full``: every parameter trains; ``lora``: peft adapters of rank 8 on
q_proj and v_proj, the optimizer over the adapters alone. Per rank after the timed steps:
``tessera.memory.model_state_bytes`` (parameters this rank holds, their gradients and the optimizer's
state). Checkpoint: the bytes on disk of one ``save_checkpoint`` after the steps (full: everything; LoRA:
with the frozen base, and the adapters alone as a run on a pretrained base writes them). Each (layout, way)
in fresh processes, interleaved and rotated per repetition; medians.

    python benchmarks/lora_state.py [--reps 3] [--steps 5] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

LAYOUTS = {"ddp": {"zero": 0}, "zero3": {"zero": 3}, "dp2xtp2": {"tp": 2}}
WAYS = ("full", "lora")
WORLD, SEQ, LOCAL_BATCH = 4, 128, 4


def _saved_bytes(folder: Path, model: torch.nn.Module, optimizer: object, frozen: bool) -> int:
    """Bytes on disk of one checkpoint of ``model`` (``frozen``: with the frozen weights)."""
    import torch.distributed as dist

    from tessera.checkpoint import save_checkpoint

    path = save_checkpoint(folder, 1, model, optimizer, {}, 1, {"run_id": "bench"}, frozen=frozen)
    size = sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
    dist.barrier()
    return size


def rank_run(layout: dict, way: str, steps: int, hidden: int, layers: int, vocab: int, folder: str) -> dict:
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
    saved = {"checkpoint_bytes": _saved_bytes(Path(folder) / "all", model, optimizer, frozen=True)}
    if way == "lora":
        saved["adapters_checkpoint_bytes"] = _saved_bytes(Path(folder) / "adapters", model, optimizer, frozen=False)
    state = int(tessera.memory.model_state_bytes(model, optimizer))
    trainable_count = sum(p.numel() for p in trainable)
    return {"state_bytes": state, "step_s": statistics.median(times[1:]), "trainable": trainable_count, **saved}


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
            with tempfile.TemporaryDirectory() as folder:
                ranks = run_ranks(rank_run, WORLD, LAYOUTS[name], way, args.steps, args.hidden, args.layers,
                                  args.vocab, folder, timeout_s=900)  # fmt: skip
            runs[f"{name} {way}"].append(ranks)
            print(f"rep {rep} {name:>5} {way:>4}: state {max(r['state_bytes'] for r in ranks) / 2**20:8.1f} MiB, "
                  f"step {max(r['step_s'] for r in ranks):.3f} s", flush=True)  # fmt: skip
    summary = {
        key: {
            "state_mib": statistics.median(max(r["state_bytes"] for r in ranks) for ranks in reps) / 2**20,
            "step_s": statistics.median(max(r["step_s"] for r in ranks) for ranks in reps),
            "trainable": reps[0][0]["trainable"],
            "checkpoint_mib": reps[0][0]["checkpoint_bytes"] / 2**20,
            "adapters_checkpoint_mib": reps[0][0].get("adapters_checkpoint_bytes", 0) / 2**20,
        }
        for key, reps in runs.items()
    }
    print(f"\n{'layout':>7} {'way':>5} {'trainable':>11} {'state MiB/rank':>15} {'step s':>7} {'ckpt MiB':>9} "
          f"{'adapters':>9}")  # fmt: skip
    for key, row in summary.items():
        name, way = key.split()
        print(f"{name:>7} {way:>5} {row['trainable']:>11,} {row['state_mib']:15.1f} {row['step_s']:7.3f} "
              f"{row['checkpoint_mib']:9.1f} {row['adapters_checkpoint_mib']:9.2f}")  # fmt: skip
    for name in LAYOUTS:
        full, lora = summary[f"{name} full"], summary[f"{name} lora"]
        print(f"{name}: LoRA state {lora['state_mib'] / full['state_mib']:.2f}x of full, "
              f"step {lora['step_s'] / full['step_s']:.2f}x")  # fmt: skip
    if args.json:
        args.json.write_text(json.dumps({"summary": summary, "runs": runs}, indent=1))


if __name__ == "__main__":
    main()
