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

# Set (True) on a laid-out model whose ranks hold one parameter in different forms (a tp replica's DTensor
# shards next to another replica's whole tensor): its checkpoints store every tensor whole.
STORE_WHOLE = "_tessera_store_whole"


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


def to_storable(tree: Any, whole: bool = False) -> Any:
    """``tree`` with every DTensor DCP cannot store redistributed to placements it can (a copy), and every
    weight that a wrapper subclass holds (:func:`unwrapped`) as its plain data. ``whole``: every DTensor
    gathered into a plain tensor (replicas that differ in tp, whose ranks must all save one form)."""

    def stored(t: torch.Tensor) -> torch.Tensor:
        t = unwrapped(t)
        if whole and isinstance(t, DTensor):
            return t.full_tensor()
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


def unwrapped(t: torch.Tensor) -> torch.Tensor:
    """A weight held by a wrapper subclass around one tensor of its own shape and dtype (torchao's float8
    training weights: bf16 or fp32 data that FSDP2 gathers in float8) as that plain tensor, sharing its
    storage (a load into it fills the weight); DCP would pickle the wrapper as an object, which a reader
    of data alone refuses and a layout without FP8 cannot take. Other tensors as they are."""
    local = t.to_local() if isinstance(t, DTensor) else t
    if type(local) in (torch.Tensor, torch.nn.Parameter) or not hasattr(local, "__tensor_flatten__"):
        return t
    names = local.__tensor_flatten__()[0]
    inner = getattr(local, names[0]) if len(names) == 1 else None
    if not isinstance(inner, torch.Tensor) or inner.shape != local.shape or inner.dtype != local.dtype:
        return t
    if isinstance(t, DTensor):
        return DTensor.from_local(inner, t.device_mesh, t.placements, shape=t.shape, stride=t.stride(), run_check=False)
    return inner
