"""Activation recompute: keep less from the forward, recompute the rest during backward.

``"full"`` recomputes every transformer block (only its input is kept), ``"selective"`` every second
one (half the saved activations for about half the extra compute, torchtitan's layer-wise selective
mode), and ``"ops"`` every block at operator level: the outputs of matrix products and attention are
kept, the cheap element-wise work between them (norms, activations, rotary embeddings) is recomputed
(torchtitan's ``op`` policy; the matmuls are most of the compute and the element-wise outputs much of
the memory). The block's ``forward`` is wrapped in place, so parameter names (and so checkpoints) do
not change. Applied after tensor parallelism and before compile and FSDP, as in torchtitan.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from tessera.errors import PlanError

aten = torch.ops.aten
# What "ops" keeps: every matrix product and attention kernel, on any device; the float8 scales' amax
# (torchao's FP8: recomputing it would re-read the whole tensor); tensor parallelism's reduce-scatter (a
# collective repeated in backward costs a second communication).
KEPT_OPS = {
    aten.mm.default,
    aten.addmm.default,
    aten.bmm.default,
    aten._scaled_mm.default,
    aten._scaled_dot_product_flash_attention.default,
    aten._scaled_dot_product_flash_attention_for_cpu.default,
    aten._scaled_dot_product_efficient_attention.default,
    aten._scaled_dot_product_cudnn_attention.default,
    aten.max.default,
    torch.ops._c10d_functional.reduce_scatter_tensor.default,
}


def _keep_matmuls(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op in KEPT_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def without_kv_cache(model: nn.Module) -> None:
    """Turn off a Hugging Face model's key/value cache (``config.use_cache``), as transformers does for its
    own gradient checkpointing: a recomputed attention layer would append its keys to the cache a second
    time, so the recompute would not see what the forward saw (op-level recompute refuses that; block
    recompute hides it). The cache serves generation, not training."""
    config = getattr(model, "config", None)
    if getattr(config, "use_cache", False):
        config.use_cache = False


def apply_recompute(blocks: list[nn.Module], mode: str) -> None:
    """Wrap the forward of the chosen ``blocks`` with non-reentrant activation checkpointing."""
    if mode == "none":
        return
    if not blocks:
        raise PlanError(
            f'Plan.recompute="{mode}" found no transformer blocks (an nn.ModuleList of same-typed modules) '
            'in this model: use recompute="none".'
        )
    every = 2 if mode == "selective" else 1
    options: dict[str, Any] = {"use_reentrant": False}
    if mode == "ops":
        options["context_fn"] = functools.partial(create_selective_checkpoint_contexts, _keep_matmuls)
    for i, block in enumerate(blocks):
        if i % every == 0:
            block.forward = functools.partial(checkpoint, block.forward, **options)  # type: ignore[method-assign]
