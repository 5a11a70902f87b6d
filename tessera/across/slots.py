"""Which part of each fragment a rank sends across groups, and how the averaged parts become its values.

Three cases, one :class:`Slicing`:

- **alone** (a group of one rank, or of shards laid out alike in every group): each rank sends all of its
  fragment's local values; the same rank of every group holds the same piece.
- **replicas** (DDP, ZeRO-1: the ranks of ``holders`` hold the same weights): they split the sync, each
  sends a slice across and they gather the averaged slices, so the model crosses once per group.
- **canonical slots** (groups that differ in size or layout, ``slots`` set): every group cuts the same
  flat of whole parameters, in the model's order, into as many slots as the smallest group has ranks, and
  rank r of each group sends slot r. A group of whole replicas cuts its own flat; a group of shards (or of
  pipeline stages) gathers each parameter whole inside the group (or sends it from its stage) to cut it,
  and takes its shards back from the averaged slots.

Slices are whole blocks of the quantiser, so compressing them equals compressing the whole, block for block.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Replicate

from tessera.across.compress import BLOCK
from tessera.across.fragments import Fragment
from tessera.distributed import local
from tessera.errors import NotSupportedYet, PlanError


@dataclass
class Whole:
    """A parameter of the whole model as groups that differ cut their slots: its name, shape and the ranks of
    this group that hold it (all of them, or one pipeline stage's)."""

    name: str
    shape: tuple[int, ...]
    holders: list[int]

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


class Slicing:
    """What this rank sends of each fragment (:meth:`slice`) and its values from the averaged parts
    (:meth:`whole`). ``params``: this rank's parameters by name; ``members``: its group's ranks;
    ``holders``: the group's ranks holding the same weights as this one (default ``members``); ``slots``:
    canonical slots, when groups differ; ``order``: the whole model's parameter names, in order (a pipeline
    stage may hold its own in another order)."""

    def __init__(
        self,
        params: dict[str, nn.Parameter],
        fragments: list[Fragment],
        members: dist.ProcessGroup | None,
        holders: dist.ProcessGroup | None,
        slots: int | None,
        order: list[str] | None,
        streaming: bool,
    ) -> None:
        self.fragments = fragments
        # Under pipelining the holders are one stage's data-parallel ranks, not the whole group.
        holders = holders if holders is not None else members
        replicated = holders is not None and dist.get_world_size(holders) > 1
        sharded = any(isinstance(p, DTensor) for p in params.values())
        self.replicas = holders if replicated and not sharded else None
        # Given, the slots are cut even in a group of one rank, so every group sends the same; the holders past
        # them send nothing across and take the averaged slots from the others.
        self.slots = slots
        self.inside = members  # the group's ranks: a sharded or staged group cuts its slots over all of them
        # A group of shards, or of pipeline stages, cuts its slots from parameters gathered or sent whole
        # inside the group: the whole model's parameters, in order, and which ranks hold each.
        self.canon: list[list[Whole]] | None = None
        if slots is not None and members is not None:
            self.canon = self._canonical_order(params, order, streaming)
        replicas = self.replicas if self.canon is None else self.inside
        self.sends = replicas is None or dist.get_rank(replicas) < (slots or dist.get_world_size(replicas))

    def _canonical_order(
        self, params: dict[str, nn.Parameter], order: list[str] | None, streaming: bool
    ) -> list[list[Whole]] | None:
        """Each fragment's whole parameters in the order every group cuts them, the model's (``order``), with
        the ranks holding each; None when every rank holds every parameter whole (replicas cut their own
        flat, in the model's order)."""
        mine = [(n, tuple(p.shape), isinstance(p, DTensor)) for n, p in params.items()]
        held: list[Any] = [None] * dist.get_world_size(self.inside)
        dist.all_gather_object(held, mine, group=self.inside)
        staged = any([n for n, _, _ in names] != [n for n, _, _ in held[0]] for names in held)
        if not staged and not any(sharded for _, _, sharded in mine):
            return None
        if staged and streaming:
            raise NotSupportedYet(
                "Streaming DiLoCo's fragments across groups that differ, with pipeline stages inside them, are not "
                "supported yet: use sync: diloco there (or lay the groups out alike)."
            )
        entries: dict[str, Whole] = {}
        for rank, names in enumerate(held):
            for name, shape, _ in names:
                entries.setdefault(name, Whole(name, shape, [])).holders.append(rank)
        if staged:
            rank_of = {name: i for i, name in enumerate(order or entries)}
            missing = [name for name in entries if name not in rank_of]
            if missing:
                raise PlanError(f"OuterSync(order=...) lacks parameters the group holds: {missing[:3]}.")
            return [sorted(entries.values(), key=lambda w: rank_of[w.name])]
        return [[entries[n] for n in fragment.names] for fragment in self.fragments]

    # ------------------------------------------------------------------ slices of replicas, or slots
    def slice(self, flat: torch.Tensor, fragment: Fragment) -> torch.Tensor:
        """This rank's slice of ``flat`` (the fragment's local values) when replicas split the sync or slots
        are canonical, else ``flat``."""
        if self.canon is not None:
            return self._cut_slot(flat, fragment)
        if self.replicas is None and self.slots is None:
            return flat
        n = self.slots or dist.get_world_size(self.replicas)
        size = -(-flat.numel() // (n * BLOCK)) * BLOCK
        padded = torch.cat([flat, flat.new_zeros(size * n - flat.numel())])
        index = dist.get_rank(self.replicas) if self.replicas is not None else 0
        return padded[index * size :][:size] if index < n else flat.new_zeros(size)  # past the slots: nothing

    def whole(self, part: torch.Tensor, numel: int, fragment: Fragment) -> torch.Tensor:
        """The fragment's local values from every slice (the inverse of :meth:`slice`), ``numel`` long."""
        if self.canon is not None:
            return self._from_slots(part, fragment)
        if self.replicas is None:
            return part[:numel]  # a slice of one: the whole, maybe padded for slots
        whole = part.new_empty(dist.get_world_size(self.replicas) * part.numel())
        dist.all_gather_into_tensor(whole, part.contiguous(), group=self.replicas)
        return whole[:numel]

    # ------------------------------------------------------------------ canonical slots of a sharded group
    def _wholes(self, fragment: Fragment) -> list[Whole]:
        assert self.canon is not None
        return self.canon[self.fragments.index(fragment)]

    def slot_size(self, fragment: Fragment) -> int:
        """Values per slot: the fragment's whole parameters cut into ``slots`` runs of whole quantiser blocks."""
        n = self.slots or 1
        total = sum(w.numel for w in self._wholes(fragment)) if self.canon else sum(p.numel() for p in fragment.params)
        return -(-total // (n * BLOCK)) * BLOCK

    def _slot_bounds(self, fragment: Fragment) -> tuple[int, int, int]:
        """(slot size, this rank's slot start, end) in the fragment's canonical flat: every parameter whole,
        in order, cut into ``slots`` runs of whole quantiser blocks (as a group of whole replicas cuts it)."""
        size, index = self.slot_size(fragment), dist.get_rank(self.inside)
        return (size, index * size, (index + 1) * size) if index < (self.slots or 1) else (size, 0, 0)

    def _cut_slot(self, flat: torch.Tensor, fragment: Fragment) -> torch.Tensor:
        """This rank's canonical slot of the fragment's values, from its pieces: each parameter gathered whole
        over its shards, and sent from its first holder to the group's other ranks when not every rank holds
        it (pipeline stages); one at a time, so a rank holds one whole parameter beside its slot."""
        size, lo, hi = self._slot_bounds(fragment)
        part, offset = flat.new_zeros(size), 0
        pieces = dict(zip(fragment.names, flat.split([local(p).numel() for p in fragment.params])))
        params = dict(zip(fragment.names, fragment.params))
        everyone = dist.get_world_size(self.inside)
        for w in self._wholes(fragment):
            if w.name in params:
                whole = _full(params[w.name], pieces[w.name].view(local(params[w.name]).shape)).flatten()
            else:
                whole = flat.new_empty(w.numel)
            if len(w.holders) < everyone:
                dist.broadcast(whole, src=dist.get_global_rank(self.inside, w.holders[0]), group=self.inside)
            a, b = max(lo, offset), min(hi, offset + w.numel)
            if a < b:
                part[a - lo : b - lo] = whole[a - offset : b - offset]
            offset += w.numel
        return part

    def _from_slots(self, part: torch.Tensor, fragment: Fragment) -> torch.Tensor:
        """The fragment's local values from the group's slots (the inverse of :meth:`_cut_slot`): each
        parameter's runs broadcast from the ranks whose slots hold them, then each holder takes its piece."""
        size = self._slot_bounds(fragment)[0]
        n, pieces, offset, mine = self.slots or 1, {}, 0, dist.get_rank(self.inside)
        params = dict(zip(fragment.names, fragment.params))
        for w in self._wholes(fragment):
            whole = part.new_empty(w.numel)
            for r in range(n):
                a, b = max(r * size, offset), min((r + 1) * size, offset + w.numel)
                if a >= b:
                    continue
                run = part[a - r * size : b - r * size].clone() if mine == r else part.new_empty(b - a)
                dist.broadcast(run, src=dist.get_global_rank(self.inside, r), group=self.inside)
                whole[a - offset : b - offset] = run
            if w.name in params:
                pieces[w.name] = _shard_of(params[w.name], whole.view(w.shape)).flatten()
            offset += w.numel
        return torch.cat([pieces[name] for name in fragment.names]) if pieces else part.new_zeros(0)  # local order


def _full(param: torch.Tensor, piece: torch.Tensor) -> torch.Tensor:
    """``piece`` (this rank's part of ``param``'s values) made whole: gathered over a shard's mesh."""
    return like(param, piece).full_tensor() if isinstance(param, DTensor) else piece


def _shard_of(param: torch.Tensor, whole: torch.Tensor) -> torch.Tensor:
    """This rank's part of ``whole`` (values shaped as ``param``), laid out as its local piece is."""
    if not isinstance(param, DTensor):
        return whole
    mesh = param.device_mesh
    replicated = DTensor.from_local(whole, mesh, [Replicate()] * mesh.ndim, run_check=False)
    return replicated.redistribute(mesh, param.placements).to_local()


def like(param: torch.Tensor, tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` (this rank's piece of ``param``) laid out as ``param`` is: a DTensor with the same mesh and
    placements for a shard, so a checkpoint stores every rank's piece once."""
    if not isinstance(param, DTensor):
        return tensor
    return DTensor.from_local(
        tensor, param.device_mesh, param.placements, run_check=False, shape=param.shape, stride=param.stride()
    )
