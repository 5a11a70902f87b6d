"""Data-parallel replicas whose pipelines differ in depth (``Plan.replicas``): the plan shape Zorse
argues for, e.g. one fast device holding every layer next to two slow ones splitting them.

Replica i takes the next ``depth_i`` ranks, one pipeline stage each (depth 1: the whole model on
one rank), or ``tp_i`` ranks holding the whole model split by tensor parallelism (tp8 inside an
8-device node next to single-device replicas). A layer sits on one rank of every replica, but not at
the same pipeline position, so there is no dp × pp grid to average over: each parameter's gradient
(each piece of it, where a tp replica splits it) is averaged over exactly the ranks that hold it,
with one process group per distinct set of holders and one flat all-reduce per group.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Shard

from tessera.distributed import local
from tessera.errors import PlanError
from tessera.parallel.data_parallel import BUCKET_BYTES  # the flat copy each all-reduce needs stays this small
from tessera.parallel.pipeline import stage_of, sum_flat_
from tessera.parallel.policy import PipelineLayout, Policy
from tessera.parallel.tensor import align_grad_placements
from tessera.plan import Plan


@dataclass(frozen=True)
class ReplicaRanks:
    """Where one rank sits: its replica, its stage in that replica, and the replica's ranks in stage order."""

    index: int
    stage: int
    ranks: tuple[int, ...]


def rank_ranges(plan: Plan) -> list[list[int]]:
    """Each replica's global ranks, stage order (the Plan's layout: consecutive ranks, one per stage, or
    its tp ranks)."""
    assert plan.replicas is not None
    return [plan.replica_ranks(i) for i in range(len(plan.replicas))]


def replica_ranks(plan: Plan, rank: int) -> ReplicaRanks:
    """The replica and stage of ``rank`` under ``plan.replicas``."""
    coords = plan.coords(rank)
    return ReplicaRanks(coords.dp, coords.pp, tuple(plan.replica_ranks(coords.dp)))


def replica_groups(plan: Plan) -> list[dist.ProcessGroup | None]:
    """One process group per replica (None for a one-rank replica); every rank makes every group."""
    return [dist.new_group(list(ranks)) if len(ranks) > 1 else None for ranks in rank_ranges(plan)]


def holding(plan: Plan, names: list[str], layout: PipelineLayout | None) -> list[list[int]]:
    """Per replica, its ranks holding the parameter known by ``names`` (several for a tied weight): the rank
    of the stage that holds each name (every stage's, for a module all stages hold), or every tp rank."""
    assert plan.replicas is not None
    out = []
    for replica, ranks in zip(plan.replicas, rank_ranges(plan)):
        if replica.depth == 1:
            out.append(ranks)
        else:
            assert layout is not None
            stages = {stage_of(n, layout, replica.stages) for n in names}
            out.append([ranks[s] for s in sorted(range(replica.depth) if None in stages else stages)])  # type: ignore[arg-type]
    return out


@dataclass(frozen=True)
class _Piece:
    """One piece of a parameter's gradient this rank holds: part ``index`` of ``parts`` along ``dim`` of its
    local gradient (the whole of it when ``parts`` is 1), scaled by ``weight`` before the sum."""

    param: nn.Parameter
    dim: int
    index: int
    parts: int
    weight: float

    def grad(self) -> torch.Tensor:
        g = local(self.param.grad)  # type: ignore[arg-type]
        return g.chunk(self.parts, dim=self.dim)[self.index] if self.parts > 1 else g


class LayerSync:
    """Averages every gradient over the ranks that hold it, once per step.

    The sum over all holders is the sum of every replica's full gradient, also for a tied weight
    whose copies sit on two stages of one replica (each copy holds the part of its own use), so
    one all-reduce per group, divided by the number of replicas, both joins ties and averages
    replicas; afterwards every copy holds the same gradient. A replica with its own tensor parallelism
    holds a split parameter in pieces: the gradient is cut into as many pieces as the largest tp degree
    splitting it (every replica cuts its own part the same way, a whole one into all of them) and each
    piece is averaged over the ranks holding it; a weight its tp ranks each hold whole (a norm) enters
    the sum once per replica (each copy weighted 1/tp). Each piece is counted in the global norm by its
    lowest-ranked holder only (``uncounted`` lists this rank's parameters another rank counts).
    """

    def __init__(
        self,
        plan: Plan,
        tied: list[list[str]],
        local: nn.Module,
        layout: PipelineLayout | None,
        before_reduce: Callable[[tuple[int, ...], int], None] | None = None,
    ) -> None:
        """``tied``: every name of each parameter of the whole model, in model order; ``local``: this
        rank's part; ``before_reduce(holder ranks, bytes)``: called before each all-reduce (emulated links)."""
        assert plan.replicas is not None
        self.replicas = len(plan.replicas)
        self.before_reduce = before_reduce
        rank = dist.get_rank()
        mine = plan.replicas[plan.coords(rank).dp]
        held = dict(local.named_parameters(remove_duplicate=False))
        self.params = list(dict.fromkeys(held.values()))
        split_dims = _split_dims(plan, held)
        by_holders: dict[tuple[int, ...], list[_Piece]] = {}
        self.uncounted: set[int] = set()
        for names in tied:
            per_replica = holding(plan, names, layout)
            param = next((held[n] for n in names if n in held), None)
            dim, pieces = _pieces(plan, names, split_dims, param)
            for k in range(pieces):
                ranks: set[int] = set()
                for replica, holders in zip(plan.replicas, per_replica):
                    split = dim is not None and replica.tp > 1
                    ranks.update([holders[k * replica.tp // pieces]] if split else holders)
                key = tuple(sorted(ranks))
                by_holders.setdefault(key, [])
                if rank not in key:
                    continue
                assert param is not None, f"rank {rank} should hold {names[0]}"
                if dim is not None and mine.tp > 1:  # this rank's shard holds pieces/tp of the pieces
                    piece = _Piece(param, dim, k % (pieces // mine.tp), pieces // mine.tp, 1.0)
                else:  # whole here: each of a tp replica's copies counts 1/tp
                    piece = _Piece(param, dim or 0, k, pieces, 1.0 / mine.tp)
                by_holders[key].append(piece)
                if rank != key[0]:
                    self.uncounted.add(id(param))
        self.buckets: list[tuple[tuple[int, ...], dist.ProcessGroup, list[_Piece]]] = []
        for ranks in sorted(by_holders):  # every rank makes every group, in the same order
            if len(ranks) > 1:
                group = dist.new_group(list(ranks))
                if rank in ranks:
                    self.buckets += [(ranks, group, bucket) for bucket in _buckets(by_holders[ranks])]

    @torch.no_grad()
    def sync(self) -> None:
        """Average this rank's gradients with their other holders (call after every backward)."""
        align_grad_placements(self.params)  # a tp gradient may arrive laid out unlike its parameter
        for ranks, group, pieces in self.buckets:  # the same order on every rank: no cross waits
            for piece in pieces:
                if piece.param.grad is None:  # an unused parameter still takes part, so the collectives match
                    piece.param.grad = torch.zeros_like(piece.param)
            grads = [piece.grad() for piece in pieces]
            for g, piece in zip(grads, pieces):
                if piece.weight != 1.0:
                    g.mul_(piece.weight)
            if self.before_reduce is not None:
                self.before_reduce(ranks, sum(g.numel() * g.element_size() for g in grads))
            sum_flat_(grads, group, divisor=self.replicas)


def check_replica_tp(policy: Policy, model: nn.Module, plan: Plan) -> None:
    """Refuse a replica's tp degree the model's sizes cannot be split by, naming the replica."""
    for i, replica in enumerate(plan.replicas or ()):
        if replica.tp > 1:
            try:
                policy.check_tp(model, replica.tp)
            except PlanError as exc:
                raise PlanError(f"Plan.replicas[{i}].tp: {exc}") from None


def _split_dims(plan: Plan, held: dict[str, nn.Parameter]) -> dict[str, int]:
    """Every rank's split parameters (a tp replica's Shard DTensors) by name, with the dimension they are
    split along: each rank learns how the others hold what it holds too."""
    assert plan.replicas is not None
    mine = {n: _shard_dim(p) for n, p in held.items()}
    mine = {n: d for n, d in mine.items() if d is not None}
    if all(r.tp == 1 for r in plan.replicas):
        return mine
    every: list[dict[str, int]] = [{} for _ in range(dist.get_world_size())]
    dist.all_gather_object(every, mine)
    out: dict[str, int] = {}
    for dims in every:
        for name, dim in dims.items():
            if out.setdefault(name, dim) != dim:
                raise PlanError(
                    f"Plan.replicas: {name} is split along dimension {out[name]} in one tp replica and {dim} in "
                    "another; their gradients cannot be averaged piece by piece. Give the replicas one tp degree."
                )
    return out


def _shard_dim(p: torch.Tensor) -> int | None:
    if not isinstance(p, DTensor):
        return None
    dims = [pl.dim for pl in p.placements if isinstance(pl, Shard)]
    return dims[0] if dims else None


def _pieces(
    plan: Plan, names: list[str], split_dims: dict[str, int], param: nn.Parameter | None
) -> tuple[int | None, int]:
    """(the dimension the parameter known by ``names`` is split along by the tp replicas, None if none splits
    it; how many pieces its gradient is averaged in: the least multiple of their tp degrees). ``param``: this
    rank's, if it holds it (its size is checked)."""
    assert plan.replicas is not None
    dim = next((split_dims[n] for n in names if n in split_dims), None)
    if dim is None:
        return None, 1
    pieces = math.lcm(*(r.tp for r in plan.replicas))
    if param is not None and param.shape[dim] % pieces:
        degrees = sorted({r.tp for r in plan.replicas})
        raise PlanError(
            f"Plan.replicas: tp degrees {degrees} average {names[0]}'s gradient in {pieces} pieces along dimension "
            f"{dim}, which its size {param.shape[dim]} does not divide: choose tp degrees that divide each other "
            "and the model's sizes."
        )
    return dim, pieces


def _buckets(pieces: list[Any]) -> list[list[Any]]:
    """``pieces`` (of parameters, or parameters) in order, cut into runs of at most :data:`BUCKET_BYTES` (one
    may exceed it alone)."""
    out: list[list[Any]] = [[]]
    size = 0
    for p in pieces:
        param = p.param if isinstance(p, _Piece) else p
        nbytes = param.numel() * param.element_size() // (p.parts if isinstance(p, _Piece) else 1)
        if out[-1] and size + nbytes > BUCKET_BYTES:
            out.append([])
            size = 0
        out[-1].append(p)
        size += nbytes
    return [b for b in out if b]
