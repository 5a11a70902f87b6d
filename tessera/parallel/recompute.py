"""Activation recompute: keep only block inputs in forward, recompute the rest during backward.

``"full"`` recomputes every transformer block, ``"selective"`` every second one (half the
saved activations for about half the extra compute, torchtitan's layer-wise selective mode).
The block's ``forward`` is wrapped in place, so parameter names (and so checkpoints) do not
change. Applied after tensor parallelism and before FSDP, as in torchtitan.
"""

from __future__ import annotations

import functools

from torch import nn
from torch.utils.checkpoint import checkpoint

from tessera.errors import PlanError


def apply_recompute(blocks: list[nn.Module], mode: str) -> None:
    """Wrap the forward of the chosen ``blocks`` with non-reentrant activation checkpointing."""
    if mode == "none":
        return
    if not blocks:
        raise PlanError(
            f'Plan.recompute="{mode}" found no transformer blocks (an nn.ModuleList of same-typed modules) '
            'in this model: use recompute="none".'
        )
    every = 1 if mode == "full" else 2
    for i, block in enumerate(blocks):
        if i % every == 0:
            forward = block.forward
            block.forward = functools.partial(checkpoint, forward, use_reentrant=False)  # type: ignore[method-assign]
