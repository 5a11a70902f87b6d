"""Packed records: several whole records in one sequence, kept apart by the attention mask built here.

The data side (:class:`tessera.data.instructions.InstructionData` with ``pack``) says which record each token
belongs to (``documents``); the runtime turns that into a model's attention mask (a flat model's keyword
inputs, each pipeline stage's own), so neither needs the other.
"""

from __future__ import annotations

import torch


def records_mask(documents: torch.Tensor) -> torch.Tensor:
    """(batch, 1, seq, seq): a token may attend to the earlier tokens of its own record only (``documents``:
    each token's record in its sequence, (batch, seq))."""
    seq = documents.shape[1]
    causal = torch.ones(seq, seq, dtype=torch.bool, device=documents.device).tril()
    same = documents[:, :, None] == documents[:, None, :]
    return (same & causal)[:, None]
