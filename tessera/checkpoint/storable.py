"""DTensors as DCP can store them, and back.

DCP stores each rank's shard as one contiguous chunk; a few layouts are not one chunk per rank and are
stored gathered along one mesh dimension instead (:func:`storable`).
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.tensor import DTensor, Replicate
from torch.distributed.tensor.placement_types import _StridedShard

from tessera.data.sharding import map_tensors


def storable(placements: tuple) -> tuple | None:
    """Placements DCP can store for a DTensor laid out as ``placements``, or None if it can already.

    DCP stores each rank's shard as one contiguous chunk. A strided split that no later mesh
    dimension refines (GPT-2's fused q|k|v weight: every rank holds three separate column
    ranges) is not one chunk, so it is stored gathered along that mesh dimension. FSDP-over-tp's
    strided split is refined by the tp Shard after it, and DCP stores that fine.
    """
    out = list(placements)
    for i, p in enumerate(placements):
        if isinstance(p, _StridedShard) and not any(q.is_shard(p.dim) for q in placements[i + 1 :]):
            out[i] = Replicate()
    return tuple(out) if out != list(placements) else None


def to_storable(tree: Any) -> Any:
    """``tree`` with every DTensor DCP cannot store redistributed to placements it can (a copy)."""

    def stored(t: torch.Tensor) -> torch.Tensor:
        placements = storable(t.placements) if isinstance(t, DTensor) else None
        return t.redistribute(placements=placements) if placements is not None else t

    return map_tensors(tree, stored)


def from_storable(loaded: Any, like: Any) -> Any:
    """``loaded`` with each tensor laid out like its twin in ``like`` (undoes :func:`to_storable`)."""
    if isinstance(loaded, dict):
        return {k: from_storable(v, like[k]) for k, v in loaded.items()}
    if isinstance(loaded, list):
        return [from_storable(v, w) for v, w in zip(loaded, like)]
    if isinstance(loaded, DTensor) and isinstance(like, DTensor) and loaded.placements != like.placements:
        return loaded.redistribute(placements=like.placements)
    return loaded
