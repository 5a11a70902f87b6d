"""Ulysses sequence parallelism (DeepSpeed-Ulysses style), written here: all-to-all attention.

Each of the P ranks of the ``sp`` group holds a contiguous 1/P slice of the sequence. Around
attention, one all-to-all turns "my tokens, all heads" into "all tokens, my heads"; attention
runs over the full sequence for H/P heads, and a second all-to-all turns it back. Query heads
must divide by P; key/value heads too, or they are repeated up to the query heads first
(grouped-query attention with fewer kv heads than ranks).

This module is the attention building block and its parity test; wiring it into the models
(sequence-sliced data, rotary offsets, the loss over all ranks' tokens) is still to come.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.nn.functional import all_to_all_single

from tessera.errors import PlanError


def _all_to_all(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """Differentiable all-to-all over dim 0 (chunk j goes to rank j)."""
    x = x.contiguous()
    # Not empty_like: it would copy a permuted input's strides, and the collective writes plain rows.
    return all_to_all_single(torch.empty(x.shape, dtype=x.dtype, device=x.device), x, group=group)


def seq_to_heads(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """(batch, heads, seq/P, dim) → (batch, heads/P, seq, dim)."""
    p = dist.get_world_size(group)
    b, h, s, d = x.shape
    chunks = x.reshape(b, p, h // p, s, d).permute(1, 0, 2, 3, 4)  # chunk j: the heads rank j will own
    out = _all_to_all(chunks, group)  # out[j]: rank j's tokens for my heads
    return out.permute(1, 2, 0, 3, 4).reshape(b, h // p, p * s, d)


def heads_to_seq(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """(batch, heads/P, seq, dim) → (batch, heads, seq/P, dim): the inverse of seq_to_heads."""
    p = dist.get_world_size(group)
    b, h, s, d = x.shape
    chunks = x.reshape(b, h, p, s // p, d).permute(2, 0, 1, 3, 4)  # chunk j: rank j's tokens
    out = _all_to_all(chunks, group)  # out[j]: my tokens for rank j's heads
    return out.permute(1, 0, 2, 3, 4).reshape(b, p * h, s // p, d)


def ulysses_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: dist.ProcessGroup, is_causal: bool = True
) -> torch.Tensor:
    """Causal attention over the whole sequence for inputs holding this rank's sequence slice.

    Args: q (batch, heads, seq/P, dim); k, v (batch, kv_heads, seq/P, dim). Returns the output
    for this rank's slice, shaped like q. Equal to attention on the gathered sequence.
    """
    p = dist.get_world_size(group)
    heads, kv_heads = q.shape[1], k.shape[1]
    if heads % p:
        raise PlanError(
            f"Ulysses sequence parallelism: {heads} attention heads do not divide by sp={p}; "
            "choose an sp that divides the number of heads."
        )
    if kv_heads % p:  # fewer kv heads than ranks: give every query head its own kv head first
        k, v = k.repeat_interleave(heads // kv_heads, dim=1), v.repeat_interleave(heads // kv_heads, dim=1)
    q, k, v = seq_to_heads(q, group), seq_to_heads(k, group), seq_to_heads(v, group)
    repeat = q.shape[1] // k.shape[1]  # grouped-query attention on the local heads
    if repeat > 1:
        k, v = k.repeat_interleave(repeat, dim=1), v.repeat_interleave(repeat, dim=1)
    out = F.scaled_dot_product_attention(q, k, v, is_causal=is_causal)
    return heads_to_seq(out, group)
