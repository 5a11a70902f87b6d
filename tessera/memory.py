"""Exact accounting of model-state bytes on this rank (tensors, not process RSS).

Example:
    >>> n = model_state_bytes(model, optimizer)
    >>> n.params, n.grads, n.optimizer, int(n)     # int(n) is the total
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from tessera.distributed import local


class StateBytes(int):
    """Total bytes (an int) that also carries the parts: ``params``, ``grads``, ``optimizer``."""

    params: int
    grads: int
    optimizer: int

    def __new__(cls, params: int, grads: int, optimizer: int) -> StateBytes:
        obj = super().__new__(cls, params + grads + optimizer)
        obj.params, obj.grads, obj.optimizer = params, grads, optimizer
        return obj

    def __repr__(self) -> str:
        return f"StateBytes(params={self.params}, grads={self.grads}, optimizer={self.optimizer})"


def _tensors(obj: Any) -> Iterable[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        yield local(obj)
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from _tensors(v)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from _tensors(v)


def _bytes(tensors: Iterable[torch.Tensor], seen: set[tuple[str, int]]) -> int:
    """Bytes of the storages behind ``tensors``, each storage counted once across calls."""
    total = 0
    for t in tensors:
        storage = t.untyped_storage()
        key = (str(t.device), storage.data_ptr())
        if storage.nbytes() == 0 or key in seen:
            continue
        seen.add(key)
        total += storage.nbytes()
    return total


def _optimizer_state(optimizer: Any) -> Any:
    # Unwrap BoostedOptimizer / ShardedOptimizer to the optimizer that owns the state.
    while hasattr(optimizer, "inner") or hasattr(optimizer, "local"):
        optimizer = getattr(optimizer, "inner", None) or optimizer.local
    return optimizer.state


def model_state_bytes(model: nn.Module, optimizer: Any | None = None) -> StateBytes:
    """This rank's bytes of parameters, gradients and optimizer state.

    Sharded tensors count only their local shard; tensors sharing storage (views,
    tied weights, DDP gradient buckets) count once.
    """
    seen: set[tuple[str, int]] = set()
    params = list(model.parameters())
    p_bytes = _bytes((local(p) for p in params), seen)
    g_bytes = _bytes((local(p.grad) for p in params if p.grad is not None), seen)
    o_bytes = _bytes(_tensors(dict(_optimizer_state(optimizer))), seen) if optimizer is not None else 0
    return StateBytes(p_bytes, g_bytes, o_bytes)
