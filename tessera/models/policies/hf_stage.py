"""What a Hugging Face family's pipeline stage computes before its blocks, the same for every family:
the positions of its tokens and the attention mask (no cache)."""

from __future__ import annotations

import torch
from torch import nn


def stage_positions(stage: nn.Module, given: torch.Tensor | None, seq: int, device: torch.device) -> torch.Tensor:
    """``given`` (packed records' own positions), else 0.. ``seq`` offset to this rank's slice under Ulysses."""
    from tessera.parallel import sequence

    return given if given is not None else sequence.position_ids(seq, stage.sp_group, device)


def stage_mask(
    stage: nn.Module, h: torch.Tensor, attention_mask: torch.Tensor | None, position_ids: torch.Tensor
) -> torch.Tensor | None:
    """Causal, or ``attention_mask`` as it is when it is 4D (packed records: each token sees its own record)."""
    from transformers.masking_utils import create_causal_mask

    return create_causal_mask(
        config=stage.config, inputs_embeds=h, attention_mask=attention_mask, cache=None, position_ids=position_ids
    )
