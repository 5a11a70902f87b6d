"""Shared pieces of the parity tests: tiny models, data, a plain single-process reference.

The reference uses plain PyTorch only (no Tessera), so a Tessera layout that
changes the numbers cannot hide behind a Tessera reference.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Dataset

from tessera.models import hf

SEQ = 16
VOCAB = 128
GLOBAL_BATCH_DEFAULT = 8


def make_optimizer(params, lr: float = 1e-3) -> torch.optim.Optimizer:
    """AdamW for every parity run. eps=1e-6, not 1e-8: a parameter whose true gradient is
    zero (GPT-2's attention key bias) otherwise gets updates of normalised rounding noise,
    which no layout can reproduce bit-for-bit."""
    return torch.optim.AdamW(params, lr=lr, eps=1e-6)


class TokenData(Dataset):
    """Random token sequences; target is the next token."""

    def __init__(self, n: int = 64, seed: int = 1234) -> None:
        g = torch.Generator().manual_seed(seed)
        self.tokens = torch.randint(0, VOCAB, (n, SEQ + 1), generator=g)

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"x": self.tokens[i, :-1], "y": self.tokens[i, 1:]}


def build_model(kind: str, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    if kind in ("llama", "llama_tied"):
        from tessera.models import Llama, LlamaConfig

        cfg = LlamaConfig(
            vocab_size=VOCAB,
            dim=32,
            n_layers=2,
            n_heads=4,
            n_kv_heads=2,
            ffn_dim=64,
            max_seq_len=SEQ,
            tie_embeddings=kind == "llama_tied",
        )
        return Llama(cfg)
    if kind == "gpt2":
        return hf.gpt2(n_layer=2, n_embd=32, n_head=4, vocab_size=VOCAB, seq_len=SEQ)
    if kind == "hf_llama":
        return hf.llama(n_layer=2, hidden=32, n_head=4, n_kv_head=2, ffn=64, vocab_size=VOCAB, seq_len=SEQ)
    if kind == "hf_qwen2":
        return hf.qwen2(n_layer=2, hidden=32, n_head=4, n_kv_head=2, ffn=64, vocab_size=VOCAB, seq_len=SEQ)
    raise ValueError(kind)


def loss_fn(output, y: torch.Tensor) -> torch.Tensor:
    logits = output.logits if hasattr(output, "logits") else output
    return F.cross_entropy(logits.float().flatten(0, 1), y.flatten())


def global_batches(dataset: TokenData, global_batch: int, steps: int, seed: int = 0):
    """The global batches a single process sees (same shuffle rule as the sharded loader)."""
    order = torch.randperm(len(dataset), generator=torch.Generator().manual_seed(seed))
    for b in range(steps):
        idx = order[b * global_batch : (b + 1) * global_batch]
        yield dataset.tokens[idx, :-1], dataset.tokens[idx, 1:]


def reference_run(kind: str, global_batch: int, steps: int, lr: float = 1e-3, max_norm: float | None = None):
    """Plain single-process AdamW training: losses, grad norms and final parameters."""
    model = build_model(kind)
    opt = make_optimizer(model.parameters(), lr)
    losses, norms = [], []
    for x, y in global_batches(TokenData(), global_batch, steps):
        loss = loss_fn(model(x), y)
        loss.backward()
        # max_norm=inf records the global norm without clipping: Adam hides a uniformly
        # mis-scaled gradient, the norm does not.
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm or float("inf"))))
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return {"losses": losses, "norms": norms, "params": {k: v.detach().clone() for k, v in model.state_dict().items()}}


def tessera_run(
    plan_dict: dict, kind: str, global_batch: int, steps: int, lr: float = 1e-3, max_norm: float | None = None
):
    """The same training through Tessera on the current ranks (call inside run_ranks)."""
    import torch.distributed as dist

    import tessera

    model = build_model(kind)
    booster = tessera.Booster(tessera.Plan.from_dict(plan_dict))
    model, opt = booster.boost(model, make_optimizer(model.parameters(), lr))
    loader = booster.dataloader(TokenData(), global_batch_size=global_batch, seed=0)
    losses, norms = [], []
    for step, batch in enumerate(loader):
        if step == steps:
            break
        loss = loss_fn(model(batch["x"]), batch["y"])
        booster.backward(loss, opt)
        norms.append(float(booster.clip_grad_norm(model, opt, max_norm=max_norm or float("inf"))))
        opt.step()
        opt.zero_grad()
        losses.append(float(booster.reduce_loss(loss)))
    state = booster.full_state_dict(model)
    return {"losses": losses, "norms": norms, "params": state if dist.get_rank() == 0 else None}


def assert_same_training(got: dict, want: dict, rtol: float = 1e-5, atol: float = 1e-5) -> None:
    torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(want["losses"]), rtol=rtol, atol=atol)
    torch.testing.assert_close(torch.tensor(got["norms"]), torch.tensor(want["norms"]), rtol=rtol, atol=atol)
    assert got["params"].keys() == want["params"].keys()
    for k, v in want["params"].items():
        torch.testing.assert_close(got["params"][k], v, rtol=rtol, atol=atol, msg=lambda m, k=k: f"parameter {k}: {m}")
