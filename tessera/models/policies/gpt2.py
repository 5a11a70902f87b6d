"""Policy for Hugging Face ``GPT2LMHeadModel``: tensor (and split/gather sequence) parallelism,
pipeline stages, Ulysses attention.

GPT-2's projections are ``Conv1D`` layers with the fused q/k/v ``c_attn``: they get
:class:`~tessera.parallel.conv1d.Conv1DParallel` (strided q/k/v split). GPT-2 ties its head to
the token embedding: under tp both are sharded over the vocabulary alike and re-tied; under
pipeline parallelism the first and last stages each hold a copy and ``TiedWeights`` keeps them
equal.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleOutput,
    RowwiseParallel,
    SequenceParallel,
)

from tessera.models.policies.hf_stage import stage_mask, stage_positions
from tessera.parallel.conv1d import Conv1DParallel
from tessera.parallel.policy import PipelineLayout, Policy


def _is_gpt2(model: nn.Module) -> bool:
    return type(model).__name__ == "GPT2LMHeadModel"


def _tp_plan(model: nn.Module) -> dict[str, ParallelStyle]:
    return {
        "transformer.wte": RowwiseParallel(input_layouts=Replicate()),  # vocabulary-parallel embedding
        "transformer.h.*.attn.c_attn": Conv1DParallel("colwise", blocks=3),
        "transformer.h.*.attn.c_proj": Conv1DParallel("rowwise"),
        "transformer.h.*.mlp.c_fc": Conv1DParallel("colwise"),
        "transformer.h.*.mlp.c_proj": Conv1DParallel("rowwise"),
        "lm_head": ColwiseParallel(output_layouts=Replicate()),
    }


def _sequence_parallel_plan(model: nn.Module) -> dict[str, ParallelStyle]:
    """Megatron split/gather: the residual stream is a DTensor sharded on the sequence, so
    ``GPT2Model`` still sees the full length (positions); the position embedding is computed
    whole and handed on as sequence shards."""
    return {
        "transformer.wte": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1), use_local_output=False),
        "transformer.wpe": PrepareModuleOutput(
            output_layouts=Replicate(), desired_output_layouts=Shard(1), use_local_output=False
        ),
        "transformer.h.*.ln_1": SequenceParallel(),
        "transformer.h.*.attn.c_attn": Conv1DParallel("colwise", blocks=3, sequence_parallel=True),
        "transformer.h.*.attn.c_proj": Conv1DParallel("rowwise", sequence_parallel=True),
        "transformer.h.*.ln_2": SequenceParallel(),
        "transformer.h.*.mlp.c_fc": Conv1DParallel("colwise", sequence_parallel=True),
        "transformer.h.*.mlp.c_proj": Conv1DParallel("rowwise", sequence_parallel=True),
        "transformer.ln_f": SequenceParallel(),
        "lm_head": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate()),
    }


def _after_tp(module: nn.Module, tp: int) -> None:
    """Attention splits c_attn's local output into q, k, v of embed_dim / tp each; the head is
    re-tied to the embedding (both weights are Shard(0) over the vocabulary)."""
    for block in module.get_submodule("transformer.h").children():
        block.attn.split_size = module.config.n_embd // tp
    if module.config.tie_word_embeddings and hasattr(module, "lm_head") and hasattr(module.transformer, "wte"):
        module.lm_head.weight = module.transformer.wte.weight


def _stage_forward(
    stage: nn.Module,
    x: torch.Tensor,
    position_ids: torch.Tensor | None = None,
    attention_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """One pipeline stage: the block loop of ``GPT2Model.forward`` (no cache; causal, or packed records'
    positions and 4D mask)."""
    inner = stage.transformer
    position_ids = stage_positions(stage, position_ids, x.shape[1], x.device)
    h = inner.drop(inner.wte(x) + inner.wpe(position_ids)) if hasattr(inner, "wte") else x
    mask = stage_mask(stage, h, attention_mask, position_ids)
    for block in inner.h.values():
        h = block(h, None, mask, position_ids=position_ids)
    return stage.lm_head(inner.ln_f(h)) if hasattr(stage, "lm_head") else h


def _ulysses(model: nn.Module, group: object) -> None:
    from tessera.parallel.sequence import enable_hf_ulysses

    enable_hf_ulysses(model, [block.attn for block in model.transformer.h], group)  # type: ignore[arg-type]


GPT2 = Policy(
    name="Hugging Face GPT-2",
    matches=_is_gpt2,
    sizes=lambda m: {
        "n_head": m.config.n_head,
        "n_inner": m.config.n_inner or 4 * m.config.n_embd,
        "vocab_size": m.config.vocab_size,
    },
    tp_plan=_tp_plan,
    sequence_parallel_plan=_sequence_parallel_plan,
    after_tp=_after_tp,
    head="lm_head",
    tied_embeddings=lambda m: bool(getattr(m.config, "tie_word_embeddings", True)),
    ulysses=_ulysses,
    pipeline=PipelineLayout(
        layers="transformer.h",
        first=("transformer.wte", "transformer.wpe", "transformer.drop"),
        last=("transformer.ln_f", "lm_head"),
        forward=_stage_forward,
        packs=True,
    ),
)
