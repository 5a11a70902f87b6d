"""Policy for Hugging Face ``LlamaForCausalLM`` (and families with the same module names)."""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
)

from tessera.errors import PlanError
from tessera.models.policies.hf_stage import stage_mask, stage_positions
from tessera.parallel.policy import PipelineLayout, Policy


def _is_hf_llama(model: nn.Module) -> bool:
    return type(model).__name__ in ("LlamaForCausalLM", "Qwen2ForCausalLM", "MistralForCausalLM")


def _stage_forward(
    stage: nn.Module,
    x: torch.Tensor,
    position_ids: torch.Tensor | None = None,
    attention_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """One pipeline stage: the decoder loop of ``LlamaModel.forward`` (no cache; causal, or packed records'
    positions and 4D mask)."""
    inner = stage.model
    h = inner.embed_tokens(x) if hasattr(inner, "embed_tokens") else x
    position_ids = stage_positions(stage, position_ids, h.shape[1], h.device)
    mask = stage_mask(stage, h, attention_mask, position_ids)
    position_embeddings = inner.rotary_emb(h, position_ids=position_ids)
    for layer in inner.layers.values():
        h = layer(h, attention_mask=mask, position_ids=position_ids, position_embeddings=position_embeddings)
    return stage.lm_head(inner.norm(h)) if hasattr(stage, "lm_head") else h


def _check_full_attention(model: nn.Module) -> None:
    kinds = set(getattr(model.config, "layer_types", None) or ["full_attention"])
    if kinds != {"full_attention"}:
        raise PlanError(
            f"Plan.pp > 1: {type(model).__name__} has {sorted(kinds)} layers; pipeline stages support full causal "
            "attention only (set use_sliding_window=False) or use pp=1."
        )


def _sequence_parallel_plan(model: nn.Module) -> dict[str, ParallelStyle]:
    """Megatron split/gather. The residual stream stays a DTensor sharded on the sequence
    (``use_local_output=False``), so the model sees the full sequence length and builds positions
    and rotary tables for all of it; attention and the MLP all-gather their input."""
    layers = "model.layers.*"
    return {
        "model.embed_tokens": RowwiseParallel(
            input_layouts=Replicate(), output_layouts=Shard(1), use_local_output=False
        ),
        f"{layers}.input_layernorm": SequenceParallel(),
        f"{layers}.self_attn": PrepareModuleInput(
            input_kwarg_layouts={"hidden_states": Shard(1)}, desired_input_kwarg_layouts={"hidden_states": Replicate()}
        ),
        f"{layers}.self_attn.q_proj": ColwiseParallel(),
        f"{layers}.self_attn.k_proj": ColwiseParallel(),
        f"{layers}.self_attn.v_proj": ColwiseParallel(),
        f"{layers}.self_attn.o_proj": RowwiseParallel(output_layouts=Shard(1), use_local_output=False),
        f"{layers}.post_attention_layernorm": SequenceParallel(),
        f"{layers}.mlp": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
        f"{layers}.mlp.gate_proj": ColwiseParallel(),
        f"{layers}.mlp.up_proj": ColwiseParallel(),
        f"{layers}.mlp.down_proj": RowwiseParallel(output_layouts=Shard(1), use_local_output=False),
        "model.norm": SequenceParallel(),
        "lm_head": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate()),
    }


def _ulysses(model: nn.Module, group: object) -> None:
    from tessera.parallel.sequence import enable_hf_ulysses

    enable_hf_ulysses(model, [layer.self_attn for layer in model.model.layers], group)  # type: ignore[arg-type]


HF_LLAMA = Policy(
    name="Hugging Face Llama",
    matches=_is_hf_llama,
    sizes=lambda m: {
        "num_attention_heads": m.config.num_attention_heads,
        "num_key_value_heads": m.config.num_key_value_heads,
        "intermediate_size": m.config.intermediate_size,
        "vocab_size": m.config.vocab_size,
    },
    tp_plan=lambda m: {
        "model.embed_tokens": RowwiseParallel(input_layouts=Replicate()),
        "model.layers.*.self_attn.q_proj": ColwiseParallel(),
        "model.layers.*.self_attn.k_proj": ColwiseParallel(),
        "model.layers.*.self_attn.v_proj": ColwiseParallel(),
        "model.layers.*.self_attn.o_proj": RowwiseParallel(),
        "model.layers.*.mlp.gate_proj": ColwiseParallel(),
        "model.layers.*.mlp.up_proj": ColwiseParallel(),
        "model.layers.*.mlp.down_proj": RowwiseParallel(),
        "lm_head": ColwiseParallel(output_layouts=Replicate()),
    },
    head="lm_head",
    tied_embeddings=lambda m: bool(getattr(m.config, "tie_word_embeddings", False)),
    ulysses=_ulysses,
    sequence_parallel_plan=_sequence_parallel_plan,
    pipeline=PipelineLayout(
        layers="model.layers",
        first=("model.embed_tokens",),
        last=("model.norm", "lm_head"),
        every=("model.rotary_emb",),
        forward=_stage_forward,
        check=_check_full_attention,
        packs=True,
    ),
)
