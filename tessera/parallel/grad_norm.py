"""The one place gradient norms are computed and clipped.

A gradient is either replicated (every rank holds all of it: DDP, ZeRO-1) or
sharded: a DTensor (FSDP2: ZeRO-2/3, tp, ep), or a plain tensor whose parameter names the
groups it is split over (uneven expert shares: ``split``). Sharded parts are summed across the
ranks that hold them exactly once; replicated parts are counted once locally.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Iterable, Mapping, Sequence

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from tessera.distributed import local


def _sharded_over(g: DTensor) -> list[int]:
    """Mesh dims over which ``g`` is split. Anything neither replicated nor partial splits the
    elements: Shard, and FSDP2-over-TP's _StridedShard (which is not a Shard subclass)."""
    return [i for i, p in enumerate(g.placements) if not (p.is_replicate() or p.is_partial())]


def _partial(t: torch.Tensor, inf_norm: bool) -> torch.Tensor:
    if not t.numel():
        return torch.zeros((), device=t.device)
    return t.abs().max() if inf_norm else t.pow(2).sum()


@torch.no_grad()
def global_grad_norm(
    params: Iterable[torch.nn.Parameter],
    norm_type: float = 2.0,
    across: Sequence[dist.ProcessGroup] = (),
    uncounted: Collection[int] = (),
    split: Mapping[int, tuple[dist.ProcessGroup, ...]] = {},
    pieces: bool = False,
) -> torch.Tensor:
    """The norm of all gradients as if the model were on one device (every rank gets it).

    ``across``: groups whose ranks hold disjoint parameters (pipeline stages); the local
    totals are combined over them once, after the sharded parts are complete. ``uncounted``:
    ids of parameters whose gradient another rank counts (a tied weight's second copy).
    ``split``: for plain parameters split by hand (uneven expert shares), by id, the groups
    their elements are split over. ``pieces``: every counted local part is a piece no other counted part
    repeats (replicas that differ in tp): they are added over ``across`` alone, not first over their
    shard groups."""
    grads = [(p, p.grad) for p in params if p.grad is not None and id(p) not in uncounted]
    inf_norm = math.isinf(norm_type)
    if not inf_norm and norm_type != 2.0:
        raise ValueError(f"norm_type must be 2 or inf, got {norm_type}")
    device = grads[0][1].device if grads else torch.device("cpu")
    replicated = torch.zeros((), device=device, dtype=torch.float32)
    # Sharded gradients: one partial sum per set of groups over which they are split, reduced once over them.
    sharded: dict[tuple, tuple[torch.Tensor, tuple[dist.ProcessGroup, ...]]] = {}
    for p, g in grads:
        t = local(g).float()
        part = _partial(t, inf_norm)
        groups = () if pieces else _shard_groups(g) + split.get(id(p), ())
        if groups:
            acc = sharded.setdefault(tuple(id(x) for x in groups), (torch.zeros((), device=t.device), groups))[0]
        else:
            acc = replicated
        if inf_norm:
            torch.maximum(acc, part, out=acc)
        else:
            acc += part
    total = replicated
    op = dist.ReduceOp.MAX if inf_norm else dist.ReduceOp.SUM
    for acc, groups in sharded.values():
        for group in groups:
            dist.all_reduce(acc, op=op, group=group)
        total = torch.maximum(total, acc) if inf_norm else total + acc
    for group in across:
        dist.all_reduce(total, op=op, group=group)
    return total if inf_norm else total.sqrt()


@torch.no_grad()
def clip_grads_(
    params: Iterable[torch.nn.Parameter],
    max_norm: float,
    norm_type: float = 2.0,
    across: Sequence[dist.ProcessGroup] = (),
    uncounted: Collection[int] = (),
    split: Mapping[int, tuple[dist.ProcessGroup, ...]] = {},
    pieces: bool = False,
) -> torch.Tensor:
    """Clip gradients in place to ``max_norm`` of the global norm; return that norm (``split``, ``pieces``: as
    for :func:`global_grad_norm`).

    Same rule as ``torch.nn.utils.clip_grad_norm_``: scale by
    ``max_norm / (norm + 1e-6)`` when that is below one.
    """
    params = list(params)
    total = global_grad_norm(params, norm_type, across, uncounted, split, pieces)
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    grads = [local(p.grad) for p in params if p.grad is not None]
    if grads:
        torch._foreach_mul_(grads, coef.to(grads[0].device))
    return total


def _shard_groups(p: torch.Tensor) -> tuple[dist.ProcessGroup, ...]:
    """The process groups across which ``p``'s elements are split (none when replicated)."""
    if isinstance(p, DTensor):
        return tuple(p.device_mesh.get_group(d) for d in _sharded_over(p))
    return getattr(p, "_tessera_shard_groups", ())  # a ZeRO-1 piece of a larger parameter


@torch.no_grad()
def reduce_layer_sums(params: list[torch.Tensor], local_sums: torch.Tensor) -> torch.Tensor:
    """Complete per-parameter sums (row i belongs to ``params[i]``) across the ranks that hold
    pieces of that parameter: one all-reduce per distinct sharding, whatever the layout.

    Layer-wise optimizers (LAMB, LARS) need the norm of the *whole* layer; summing only the
    local shard is the classic silent bug under ZeRO or tensor parallelism.
    """
    by_groups: dict[tuple[int, ...], tuple[tuple[dist.ProcessGroup, ...], list[int]]] = {}
    for i, p in enumerate(params):
        groups = _shard_groups(p)
        if groups:
            by_groups.setdefault(tuple(id(g) for g in groups), (groups, []))[1].append(i)
    out = local_sums.clone()
    for groups, rows in by_groups.values():
        part = out[rows]
        for group in groups:
            dist.all_reduce(part, group=group)
        out[rows] = part
    return out
