"""One training step and what it needs: the learning-rate schedule, the losses (next-token, or fine-tuning's
over response tokens), forward/backward/clip/step with a collective timeout told in words, and sampling
text from the trained model."""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

import tessera
from tessera.config import Config
from tessera.data.text import ByteTokenizer
from tessera.launch.failures import CollectiveTimeout


def lr_factor(cfg: Config, step: int) -> float:
    """Warm-up, then cosine / linear decay to ``min_lr_ratio`` (or constant)."""
    s, total = cfg.schedule, cfg.train.steps
    if step < s.warmup_steps:
        return (step + 1) / s.warmup_steps
    if s.kind == "constant":
        return 1.0
    progress = min(1.0, (step - s.warmup_steps) / max(1, total - s.warmup_steps))
    decay = 0.5 * (1 + math.cos(math.pi * progress)) if s.kind == "cosine" else 1 - progress
    return s.min_lr_ratio + (1 - s.min_lr_ratio) * decay


def logits_of(output: Any) -> torch.Tensor:
    return output.logits if hasattr(output, "logits") else output


def next_token_loss(output: Any, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits_of(output).float().flatten(0, 1), targets.flatten())


def _is_timeout(exc: BaseException) -> bool:
    text = str(exc).lower()
    return "timed out" in text or "timeout" in text


def response_token_loss(booster: tessera.Booster, batch: dict) -> Any:
    """Fine-tuning's loss for ``batch``: the mean over the global batch's response tokens (targets not
    -100), whatever the layout (:meth:`tessera.Booster.token_mean_scale`)."""
    scale = booster.token_mean_scale(batch["y"])

    def loss(output: Any, targets: torch.Tensor) -> torch.Tensor:
        logits = logits_of(output).float().flatten(0, 1)
        return F.cross_entropy(logits, targets.flatten(), reduction="sum") * scale

    return loss


def train_step(
    model: nn.Module,
    optimizer: Any,
    booster: tessera.Booster,
    batch: dict,
    grad_clip: float | None,
    step: int,
    timeout_s: float,
    loss_fn: Any = next_token_loss,
) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Forward, backward, clip, optimizer step; returns (local loss, grad norm, model-state bytes).

    A collective that times out becomes a CollectiveTimeout naming the group and the step.
    """
    try:
        loss = booster.execute_pipeline(batch, model, loss_fn, optimizer)
        grad_norm = booster.clip_grad_norm(model, optimizer, max_norm=grad_clip or math.inf)
        optimizer.step()
        state_bytes = int(tessera.memory.model_state_bytes(model, optimizer))
        optimizer.zero_grad()
        return loss, grad_norm, state_bytes
    except RuntimeError as exc:
        if not _is_timeout(exc):
            raise
        if booster.plan.replicas is None:
            where = f"the data-parallel group 'dp' (ranks {dist.get_process_group_ranks(booster.mesh.get_group('dp'))})"
        else:
            where = f"the ranks of Plan.replicas (0-{dist.get_world_size() - 1})"
        raise CollectiveTimeout(
            f"a collective of step {step} on {where} did not complete "
            f"within train.timeout_s={timeout_s:g} s on rank {dist.get_rank()}: another rank died, hung or never "
            "arrived. Check that rank's log; restart with --resume to continue from the last checkpoint."
        ) from None


@torch.no_grad()
def generate(model: nn.Module, prompt: str, n_bytes: int, seq_len: int, device: torch.device, tok: Any = None) -> str:
    """Sample ``n_bytes`` tokens (bytes, with the byte tokenizer) after ``prompt``; every rank runs it (sharded
    models need all ranks). ``tok``: the run's tokenizer (bytes by default)."""
    tok = tok or ByteTokenizer()
    tokens = torch.tensor([tok.encode(prompt)], device=device)
    g = torch.Generator(device=device).manual_seed(0)  # same draws on every rank
    # Sequence-parallel modules would expect a slice of the sequence: generate on the whole one.
    sp_modules = [(m, m.sp_group) for m in model.modules() if getattr(m, "sp_group", None) is not None]
    for m, _ in sp_modules:
        m.sp_group = None
    model.eval()
    try:
        for _ in range(n_bytes):
            logits = logits_of(model(tokens[:, -seq_len:]))
            if isinstance(logits, DTensor):  # Plan.loss_parallel: split over the vocabulary
                logits = logits.full_tensor()
            logits = logits[:, -1].float()
            probs = torch.softmax(logits / 0.8, dim=-1)
            tokens = torch.cat([tokens, torch.multinomial(probs, 1, generator=g)], dim=1)
    finally:
        model.train()
        for m, group in sp_modules:
            m.sp_group = group
    return tok.decode(tokens[0].tolist())
