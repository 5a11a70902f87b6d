"""Ulysses sequence parallelism (DeepSpeed-Ulysses style), written here: all-to-all attention.

Each of the P ranks of the ``sp`` group holds a contiguous 1/P slice of the sequence. Around
attention, one all-to-all turns "my tokens, all heads" into "all tokens, my heads"; attention
runs over the full sequence for H/P heads, and a second all-to-all turns it back. Query heads
must divide by P; key/value heads too, or they are repeated up to the query heads first
(grouped-query attention with fewer kv heads than ranks).

The loader slices each sequence per rank; the model policies route attention here (the
reference Llama directly, Hugging Face models through their attention-function registry) and
start rotary positions at the rank's offset.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn.functional as F

from tessera.errors import PlanError


def _all_to_all(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """Differentiable all-to-all over dim 0 (chunk j goes to rank j)."""
    out = funcol.all_to_all_single_autograd(x.contiguous(), None, None, group)
    return funcol.wait_tensor(out)


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


def check_ulysses_heads(heads: int, sp: int) -> None:
    """Refuse an sp the attention heads cannot be split by (the all-to-all gives each rank heads/sp heads);
    the launcher asks it too, before any rank starts (:mod:`tessera.models.fits`)."""
    if heads % sp:
        raise PlanError(
            f"Ulysses sequence parallelism: {heads} attention heads do not divide by sp={sp}; "
            "choose an sp that divides the number of heads."
        )


def ulysses_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    group: dist.ProcessGroup,
    is_causal: bool = True,
    scale: float | None = None,
    dropout_p: float = 0.0,
    mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention over the whole sequence for inputs holding this rank's sequence slice.

    Args: q (batch, heads, seq/P, dim); k, v (batch, kv_heads, seq/P, dim); ``mask``: which keys each
    query of the whole sequence may see (batch, 1, seq, seq; packed records), instead of causal. Returns
    the output for this rank's slice, shaped like q. Equal to attention on the gathered sequence.
    """
    p = dist.get_world_size(group)
    heads, kv_heads = q.shape[1], k.shape[1]
    check_ulysses_heads(heads, p)
    if kv_heads % p:  # fewer kv heads than ranks: give every query head its own kv head first
        k, v = k.repeat_interleave(heads // kv_heads, dim=1), v.repeat_interleave(heads // kv_heads, dim=1)
    q, k, v = seq_to_heads(q, group), seq_to_heads(k, group), seq_to_heads(v, group)
    repeat = q.shape[1] // k.shape[1]  # grouped-query attention on the local heads
    if repeat > 1:
        k, v = k.repeat_interleave(repeat, dim=1), v.repeat_interleave(repeat, dim=1)
    if mask is not None:
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, dropout_p=dropout_p)
    else:
        out = F.scaled_dot_product_attention(q, k, v, is_causal=is_causal, scale=scale, dropout_p=dropout_p)
    return heads_to_seq(out, group)


def sequence_start(seq: int, group: dist.ProcessGroup | None) -> int:
    """Position of this rank's first token: its ``seq``-token slice starts at rank × seq under
    Ulysses (``group``), at 0 without sequence parallelism."""
    return seq * dist.get_rank(group) if group is not None else 0


def position_ids(seq: int, group: dist.ProcessGroup | None, device: torch.device) -> torch.Tensor:
    """Positions of this rank's ``seq`` tokens, shape (1, seq)."""
    start = sequence_start(seq, group)
    return torch.arange(start, start + seq, device=device).unsqueeze(0)


HF_ATTENTION = "tessera_ulysses"


def hf_ulysses_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: object,
) -> tuple[torch.Tensor, None]:
    """Hugging Face attention-function signature around :func:`ulysses_attention`: q/k/v (batch, heads,
    seq/P, dim) in, (batch, seq/P, heads, dim) out. Causal, or, given a 4D mask over the whole sequence
    (packed records: each token sees its own record's earlier tokens), that mask."""
    whole = query.shape[2] * dist.get_world_size(module.sp_group)  # type: ignore[arg-type]
    mask = attention_mask if attention_mask is not None and attention_mask.dim() == 4 else None
    if mask is not None and mask.shape[-2:] != (whole, whole):
        raise PlanError(
            f"Ulysses sequence parallelism takes a 4D attention mask over the whole sequence ({whole} tokens); "
            f"got one of shape {tuple(mask.shape)}."
        )
    out = ulysses_attention(query, key, value, module.sp_group, scale=scaling, dropout_p=dropout, mask=mask)  # type: ignore[arg-type]
    return out.transpose(1, 2).contiguous(), None


def enable_hf_ulysses(
    model: torch.nn.Module, attention_modules: list[torch.nn.Module], group: dist.ProcessGroup
) -> None:
    """Route a Hugging Face model's attention through Ulysses over ``group``.

    Registers the attention function, points each attention module at the group, and gives the
    model this rank's positions (its sequence slice starts at rank × slice length) unless the
    caller passes ``position_ids`` itself.
    """
    from transformers import AttentionInterface

    AttentionInterface.register(HF_ATTENTION, hf_ulysses_attention)
    model.set_attn_implementation(HF_ATTENTION)
    for module in attention_modules:
        module.sp_group = group
    offset_positions(model, group)


def offset_positions(model: torch.nn.Module, group: dist.ProcessGroup) -> None:
    """Give ``model``'s forward this rank's positions (its sequence slice starts at rank × slice length)
    unless the caller passes ``position_ids`` itself."""

    def positions(_: torch.nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        if kwargs.get("position_ids") is None:
            tokens = args[0] if args else kwargs.get("input_ids", kwargs.get("inputs_embeds"))
            kwargs["position_ids"] = position_ids(tokens.shape[1], group, tokens.device)
        return args, kwargs

    model.register_forward_pre_hook(positions, with_kwargs=True)
