"""Policy for Hugging Face ``GPT2LMHeadModel``: pipeline stages and Ulysses attention.

GPT-2 ties its head to the token embedding; under pipeline parallelism the first and last
stages each hold a copy and ``TiedWeights`` keeps them equal. Tensor parallelism needs the fused
``c_attn`` (a ``Conv1D`` holding q, k and v side by side) split per block, which is not built
yet: the tp plan refuses with a clear error.
"""

from __future__ import annotations

import torch
from torch import nn

from tessera.errors import NotSupportedYet
from tessera.models.policies.base import PipelineLayout, Policy


def _is_gpt2(model: nn.Module) -> bool:
    return type(model).__name__ == "GPT2LMHeadModel"


def _no_tp_plan(model: nn.Module) -> dict:
    raise NotSupportedYet(
        "tensor parallelism for GPT-2 is not supported yet (its fused c_attn Conv1D needs a strided q/k/v "
        "split): use Plan.tp=1; pipeline, Ulysses sequence parallelism and ZeRO work for GPT-2."
    )


def _stage_forward(stage: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """One pipeline stage: the block loop of ``GPT2Model.forward`` (no cache, no padding mask)."""
    from transformers.masking_utils import create_causal_mask

    inner = stage.transformer
    if hasattr(inner, "wte"):
        position_ids = torch.arange(x.shape[1], device=x.device).unsqueeze(0)
        h = inner.drop(inner.wte(x) + inner.wpe(position_ids))
    else:
        h = x
        position_ids = torch.arange(h.shape[1], device=h.device).unsqueeze(0)
    mask = create_causal_mask(
        config=stage.config, inputs_embeds=h, attention_mask=None, cache=None, position_ids=position_ids
    )
    for block in inner.h.values():
        h = block(h, None, mask, position_ids=position_ids)
    return stage.lm_head(inner.ln_f(h)) if hasattr(stage, "lm_head") else h


def _ulysses(model: nn.Module, group: object) -> None:
    from tessera.parallel.sequence import enable_hf_ulysses

    enable_hf_ulysses(model, [block.attn for block in model.transformer.h], group)  # type: ignore[arg-type]


GPT2 = Policy(
    name="Hugging Face GPT-2",
    matches=_is_gpt2,
    sizes=lambda m: {"n_head": m.config.n_head, "vocab_size": m.config.vocab_size},
    tp_plan=_no_tp_plan,
    head="lm_head",
    tied_embeddings=lambda m: bool(getattr(m.config, "tie_word_embeddings", True)),
    ulysses=_ulysses,
    pipeline=PipelineLayout(
        layers="transformer.h",
        first=("transformer.wte", "transformer.wpe", "transformer.drop"),
        last=("transformer.ln_f", "lm_head"),
        forward=_stage_forward,
    ),
)
