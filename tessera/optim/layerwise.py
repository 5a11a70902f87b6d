"""Shared machinery of layer-wise optimizers: whole-layer norms and trust ratios under any sharding."""

from __future__ import annotations

import torch

from tessera.parallel.grad_norm import reduce_layer_sums


def layer_norms(params: list[torch.Tensor], tensors: list[list[torch.Tensor]]) -> torch.Tensor:
    """Norms of whole layers: ``out[i, j]`` = ‖tensors[j][i]‖ over every shard of ``params[i]``.

    ``tensors[j][i]`` are local tensors shaped like ``params[i]``'s local part. All norms of a
    step travel in one all-reduce per sharding.
    """
    if not params:
        return torch.zeros(0, len(tensors))
    sums = torch.stack([torch.stack([t[i].float().pow(2).sum() for t in tensors]) for i in range(len(params))])
    return reduce_layer_sums(params, sums).sqrt()


def trust_ratio(weight_norm: torch.Tensor, update_norm: torch.Tensor) -> torch.Tensor:
    """‖w‖ / ‖u‖, or 1 where either norm is zero (fresh biases, zero updates)."""
    ok = (weight_norm > 0) & (update_norm > 0)
    return torch.where(ok, weight_norm / update_norm.clamp_min(1e-30), torch.ones_like(weight_norm))
