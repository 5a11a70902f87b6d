"""ZeRO-1: shard optimizer state across data-parallel ranks, keep parameters whole.

Gradients arrive already averaged (DDP all-reduce). Under tensor parallelism a parameter
is a DTensor and everything below works on its local shard: the dp ranks of one tp rank
hold shards of equal shape, so they partition them the same way. Picture all parameters
laid end to end (no copy is made): rank r owns the r-th of N equal contiguous
ranges of that line. Its piece of each parameter is a *view* into the
parameter, stepped by the user's optimizer class; then each piece is broadcast
in place from its owner. Most parameters lie inside one rank's range, so a
step costs about one collective per parameter (measured in docs/benchmarks.md).
With ``offload=True`` on an accelerator the owned pieces, their gradients and
the optimizer state live on the CPU instead.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from tessera.checkpoint.parts import OptimizerState
from tessera.distributed import local


@dataclass
class _Slice:
    full: nn.Parameter  # the replicated parameter in the model
    shard: nn.Parameter  # this rank's piece (possibly empty), stepped by the local optimizer
    start: int  # the piece is full.view(-1)[start:end]
    end: int
    group: dist.ProcessGroup  # the ranks holding ``full`` alike, among which its pieces are spread
    owners: list[tuple[int, int, int]] = field(default_factory=list)  # (group rank, lo, hi) of every piece


class ShardedOptimizer:
    """Runs the user's optimizer class on this rank's 1/N of all parameter elements.

    Exposes ``param_groups``/``state`` of the local optimizer, so learning-rate
    schedulers work unchanged. ``holders``: for a parameter only some ranks of ``group`` hold
    alike (an expert split over expert-parallel ranks), the group it is spread over instead;
    each group's parameters are laid end to end on a line of their own. ``split``: by id, the
    groups a plain parameter's elements are split over (uneven experts), for layer-wise norms.
    """

    def __init__(
        self,
        param_groups: list[dict[str, Any]],
        build_optimizer: Callable[[list[dict[str, Any]]], torch.optim.Optimizer],
        group: dist.ProcessGroup,
        offload: bool = False,
        holders: Callable[[nn.Parameter], dist.ProcessGroup | None] = lambda p: None,
        split: Mapping[int, tuple[dist.ProcessGroup, ...]] = {},
    ) -> None:
        self.group = group
        self.offload = offload
        self.split = split
        self.slices: list[_Slice] = []
        params = [p for pg in param_groups for p in pg["params"]]
        group_of = {id(p): holders(p) or group for p in params}
        lines = {id(g): g for g in group_of.values()}
        sizes = {key: sum(local(p).numel() for p in params if group_of[id(p)] is g) for key, g in lines.items()}
        per_rank = {key: max(1, math.ceil(sizes[key] / dist.get_world_size(g))) for key, g in lines.items()}
        offset = dict.fromkeys(lines, 0)
        local_groups = []
        for pg in param_groups:
            shards = []
            for p in pg["params"]:
                g = group_of[id(p)]
                s = self._make_slice(p, g, offset[id(g)], per_rank[id(g)], offload)
                offset[id(g)] += local(p).numel()
                self.slices.append(s)
                shards.append(s.shard)
            local_groups.append({**{k: v for k, v in pg.items() if k != "params"}, "params": shards})
        self.local = build_optimizer(local_groups)

    def _make_slice(
        self, p: nn.Parameter, group: dist.ProcessGroup, offset: int, per_rank: int, offload: bool
    ) -> _Slice:
        n = local(p).numel()
        world, rank = dist.get_world_size(group), dist.get_rank(group)
        owners = []
        for r in range(offset // per_rank, min(world, (offset + n - 1) // per_rank + 1) if n else 0):
            lo, hi = max(r * per_rank, offset) - offset, min((r + 1) * per_rank, offset + n) - offset
            if hi > lo:
                owners.append((r, lo, hi))
        start, end = next(((lo, hi) for r, lo, hi in owners if r == rank), (0, 0))
        view = local(p).detach().view(-1)[start:end]
        data = view.to("cpu", copy=True) if offload and view.device.type != "cpu" else view
        shard = nn.Parameter(data)
        # Layer-wise optimizers reduce norms over the holders, and over tp (or ep) when p is split there.
        split_over = (
            [p.device_mesh.get_group(d) for d, pl in enumerate(p.placements) if pl.is_shard()]
            if isinstance(p, DTensor)
            else list(self.split.get(id(p), ()))
        )
        shard._tessera_shard_groups = (group, *split_over)
        return _Slice(full=p, shard=shard, start=start, end=end, group=group, owners=owners)

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.local.param_groups

    @property
    def state(self) -> Any:
        return self.local.state

    @property
    def defaults(self) -> dict[str, Any]:
        return self.local.defaults

    @torch.no_grad()
    def step(self) -> None:
        for s in self.slices:
            if s.full.grad is None:
                s.shard.grad = None
                continue
            g = local(s.full.grad).view(-1)[s.start : s.end]
            s.shard.grad = g.to(s.shard.device) if g.device != s.shard.device else g
        self.local.step()
        self._gather_params()

    @torch.no_grad()
    def _gather_params(self) -> None:
        """Send every updated piece from its owner to all ranks, straight into the parameters.

        Each piece is a contiguous view of its parameter, so nothing is copied or padded.
        This measured faster on gloo than one bucketed all-gather (which needs two copies of
        every parameter) or one all-gather per parameter (docs/benchmarks.md).
        """
        if self.offload:
            self._copy_back_own()
        pending = [work for s in self.slices for work in self._broadcast_pieces(s, local(s.full).detach().view(-1))]
        for work in pending:
            work.wait()

    def _broadcast_pieces(self, s: _Slice, flat: torch.Tensor) -> list[dist.Work]:
        """Send each piece of ``flat`` (laid out like ``s.full``) from its owner to every rank, in place."""
        if dist.get_world_size(s.group) == 1:
            return []
        return [
            dist.broadcast(flat[lo:hi], src=dist.get_global_rank(s.group, r), group=s.group, async_op=True)
            for r, lo, hi in s.owners
        ]

    def _copy_back_own(self) -> None:
        """Offloaded slices live in CPU copies: write them back into the device parameters."""
        for s in self.slices:
            dst = local(s.full).detach().view(-1)[s.start : s.end]
            if dst.data_ptr() != s.shard.data_ptr():
                dst.copy_(s.shard.detach().view(-1))

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.local.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict[str, Any]:
        return self.local.state_dict()

    # ---------------------------------------------------- layout-independent checkpoints
    @torch.no_grad()
    def _ensure_state(self) -> None:
        """Create optimizer state before the first step (a zero-gradient step at lr 0), so a
        checkpoint can be loaded into it."""
        if self.local.state:
            return
        saved_lrs = [g["lr"] for g in self.local.param_groups]
        for g in self.local.param_groups:
            g["lr"] = 0.0
        for s in self.slices:
            s.shard.grad = torch.zeros_like(s.shard)
        self.local.step()
        self.local.zero_grad(set_to_none=True)
        for g, lr in zip(self.local.param_groups, saved_lrs):
            g["lr"] = lr

    @torch.no_grad()
    def full_state_dict(self, names: dict[int, str]) -> dict[str, Any]:
        """Optimizer state as full per-parameter tensors keyed by parameter name: the same
        shape ``torch.distributed.checkpoint`` gets from a plain optimizer, so any layout can
        load it. Transiently holds the full state (the size DDP keeps all the time)."""
        self._ensure_state()
        state: dict[str, dict[str, Any]] = {}
        pending = []
        for s in self.slices:
            local_state = self.local.state[s.shard]
            entry: dict[str, Any] = {}
            mine = local(s.full)
            for key, value in local_state.items():
                if isinstance(value, torch.Tensor) and value.numel() == s.shard.numel() and value.dim() > 0:
                    full = torch.zeros(mine.numel(), dtype=value.dtype, device=mine.device)
                    full[s.start : s.end].copy_(value.view(-1))
                    pending += self._broadcast_pieces(s, full)
                    entry[key] = _like(s.full, full.view(mine.shape))
                else:
                    entry[key] = value.clone() if isinstance(value, torch.Tensor) else value
            state[names[id(s.full)]] = entry
        for work in pending:
            work.wait()
        groups = []
        index = 0
        for g in self.local.param_groups:
            n = len(g["params"])
            fqns = [names[id(s.full)] for s in self.slices[index : index + n]]
            groups.append({**{k: v for k, v in g.items() if k != "params"}, "params": fqns})
            index += n
        return {"state": state, "param_groups": groups}

    @torch.no_grad()
    def load_full_state_dict(self, full: dict[str, Any], names: dict[int, str]) -> None:
        """Take this rank's pieces of a :meth:`full_state_dict`-shaped state."""
        self._ensure_state()
        for s in self.slices:
            saved = full["state"][names[id(s.full)]]
            local_state = self.local.state[s.shard]
            for key, value in saved.items():
                if isinstance(value, torch.Tensor) and value.numel() == s.full.numel() and value.dim() > 0:
                    value = local(value)
                    local_state[key] = value.reshape(-1)[s.start : s.end].to(s.shard.device, copy=True)
                else:
                    local_state[key] = value.clone() if isinstance(value, torch.Tensor) else value
        for g, saved_group in zip(self.local.param_groups, full["param_groups"]):
            g.update({k: v for k, v in saved_group.items() if k != "params"})

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.local.load_state_dict(state)


class ShardedOptimizerState(OptimizerState):
    """A :class:`ShardedOptimizer`'s part of a checkpoint: its state made whole per parameter, keyed by name
    (``names()``: parameter id → name, asked at each save and load), so any layout loads it."""

    def __init__(self, optimizer: ShardedOptimizer, names: Callable[[], dict[int, str]]) -> None:
        super().__init__()
        self.optimizer, self.names = optimizer, names

    def save(self) -> dict[str, Any]:
        return self.optimizer.full_state_dict(self.names())

    def load(self, state: dict[str, Any]) -> None:
        self.optimizer.load_full_state_dict(state, self.names())


def _like(param: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """``value`` (shaped like ``param``'s local shard) as a tensor laid out like ``param``: a DTensor
    with the same placements for a tensor-parallel parameter, so checkpoints hold the full state."""
    if isinstance(param, DTensor):
        return DTensor.from_local(value, param.device_mesh, param.placements, shape=param.shape, stride=param.stride())
    return value
