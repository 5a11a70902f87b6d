"""The foundation demo: a small Llama learns Python source under a ZeRO plan.

Run under torchrun (``tessera demo`` does that for you):
    torchrun --standalone --nproc-per-node 2 -m tessera.demo --zero 2 --steps 60

Data is byte-level text from the running interpreter's standard library (the
same on every machine, written by nobody here). Every rank prints nothing but
rank 0, which prints the global-batch loss each step.
"""

from __future__ import annotations

import argparse
import glob
import math
import sysconfig
import time

import torch
import torch.nn.functional as F
from torch.utils.data import Dataset

import tessera
from tessera.models import Llama, LlamaConfig


class StdlibBytes(Dataset):
    """Fixed-length windows of bytes from the Python standard library's source files."""

    def __init__(self, seq_len: int, max_bytes: int = 2_000_000) -> None:
        files = sorted(glob.glob(sysconfig.get_paths()["stdlib"] + "/*.py"))
        data = bytearray()
        for path in files:
            with open(path, "rb") as f:
                data += f.read()
            if len(data) >= max_bytes:
                break
        if len(data) < 10 * (seq_len + 1):
            raise RuntimeError("no standard-library source found: cannot build the demo corpus")
        self.tokens = torch.frombuffer(data[:max_bytes], dtype=torch.uint8).long()
        self.seq_len = seq_len

    def __len__(self) -> int:
        return (len(self.tokens) - 1) // self.seq_len

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        window = self.tokens[i * self.seq_len : (i + 1) * self.seq_len + 1]
        return {"x": window[:-1], "y": window[1:]}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--zero", type=int, default=2, help="ZeRO stage 0-3 (0 = DDP)")
    ap.add_argument("--precision", default="fp32", choices=["fp32", "bf16", "fp16"])
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--global-batch", type=int, default=16)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--lr", type=float, default=3e-3)
    args = ap.parse_args(argv)

    torch.set_num_threads(1)
    tessera.init()
    plan = (
        tessera.DDP(precision=args.precision)
        if args.zero == 0
        else tessera.ZeRO(stage=args.zero, precision=args.precision)
    )
    booster = tessera.Booster(plan)
    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=256, dim=128, n_layers=4, n_heads=4, n_kv_heads=2, ffn_dim=384, max_seq_len=args.seq_len
    )
    model = Llama(cfg)
    n_params = sum(p.numel() for p in model.parameters())
    model, optimizer = booster.boost(model, torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.1))
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: min(1.0, (s + 1) / 10) * 0.5 * (1 + math.cos(math.pi * min(s, args.steps) / args.steps))
    )
    loader = booster.dataloader(StdlibBytes(args.seq_len), global_batch_size=args.global_batch, seed=0)
    rank0 = torch.distributed.get_rank() == 0
    if rank0:
        print(
            f"tessera demo: {n_params / 1e6:.2f}M-parameter Llama, plan zero={plan.zero} precision={plan.precision}, "
            f"{booster.plan.dp} ranks, global batch {args.global_batch}×{args.seq_len} bytes",
            flush=True,
        )
    start, step, first = time.perf_counter(), 0, None
    epoch = 0
    while step < args.steps:
        loader.set_epoch(epoch)
        for batch in loader:
            logits = model(batch["x"])
            loss = F.cross_entropy(logits.float().flatten(0, 1), batch["y"].flatten())
            booster.backward(loss, optimizer)
            norm = booster.clip_grad_norm(model, optimizer, max_norm=1.0)
            optimizer.step()
            step += 1
            if step == args.steps:  # peak model state: gradients and optimizer state both alive
                state = tessera.memory.model_state_bytes(model, optimizer)
            optimizer.zero_grad()
            schedule.step()
            global_loss = booster.reduce_loss(loss).item()
            first = global_loss if first is None else first
            if rank0 and (step % 10 == 0 or step == 1):
                tok_s = step * args.global_batch * args.seq_len / (time.perf_counter() - start)
                print(
                    f"step {step:4d}  loss {global_loss:.4f}  grad-norm {float(norm):.3f}  {tok_s:,.0f} tokens/s",
                    flush=True,
                )
            if step == args.steps:
                break
        epoch += 1
    if rank0:
        print(
            f"loss {first:.3f} -> {global_loss:.3f} in {step} steps; model state on rank 0: "
            f"{state.params / 2**20:.2f} MiB params, {state.grads / 2**20:.2f} MiB grads, "
            f"{state.optimizer / 2**20:.2f} MiB optimizer",
            flush=True,
        )
    torch.distributed.barrier()  # no rank tears down while another still talks to it
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
