"""Data-parallel replicas whose pipelines differ in depth (``Plan.replicas``): the plan shape Zorse
argues for, e.g. one fast device holding every layer next to two slow ones splitting them.

Replica i takes the next ``depth_i`` ranks, one pipeline stage each (depth 1: the whole model on
one rank). A layer sits on one rank of every replica, but not at the same pipeline position, so
there is no dp × pp grid to average over: each parameter's gradient is averaged over exactly the
ranks that hold it, with one process group per distinct set of holders and one flat all-reduce
per group.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from tessera.parallel.data_parallel import BUCKET_BYTES  # the flat copy each all-reduce needs stays this small
from tessera.parallel.pipeline import stage_of, sum_flat_
from tessera.parallel.policy import PipelineLayout
from tessera.plan import Plan


@dataclass(frozen=True)
class ReplicaRanks:
    """Where one rank sits: its replica, its stage in that replica, and the replica's ranks in stage order."""

    index: int
    stage: int
    ranks: tuple[int, ...]


def rank_ranges(plan: Plan) -> list[list[int]]:
    """Each replica's global ranks, stage order (the Plan's layout: consecutive ranks, one per stage)."""
    assert plan.replicas is not None
    return [plan.replica_ranks(i) for i in range(len(plan.replicas))]


def replica_ranks(plan: Plan, rank: int) -> ReplicaRanks:
    """The replica and stage of ``rank`` under ``plan.replicas``."""
    coords = plan.coords(rank)
    return ReplicaRanks(coords.dp, coords.pp, tuple(plan.replica_ranks(coords.dp)))


def replica_groups(plan: Plan) -> list[dist.ProcessGroup | None]:
    """One process group per replica (None for a one-rank replica); every rank makes every group."""
    return [dist.new_group(list(ranks)) if len(ranks) > 1 else None for ranks in rank_ranges(plan)]


def holders(plan: Plan, names: list[str], layout: PipelineLayout | None) -> tuple[int, ...]:
    """The ranks holding the parameter known by ``names`` (several for a tied weight): in each
    replica, the rank of the stage that holds each name (every stage's, for a module all stages hold)."""
    assert plan.replicas is not None
    out: set[int] = set()
    for replica, ranks in zip(plan.replicas, rank_ranges(plan)):
        if replica.depth == 1:
            out.add(ranks[0])
        else:
            assert layout is not None
            stages = {stage_of(n, layout, replica.stages) for n in names}
            out.update(ranks[s] for s in (range(replica.depth) if None in stages else stages))  # type: ignore[arg-type]
    return tuple(sorted(out))


class LayerSync:
    """Averages every gradient over the ranks that hold its parameter, once per step.

    The sum over all holders is the sum of every replica's full gradient, also for a tied weight
    whose copies sit on two stages of one replica (each copy holds the part of its own use), so
    one all-reduce per group, divided by the number of replicas, both joins ties and averages
    replicas; afterwards every copy holds the same gradient. Each shared gradient is counted in
    the global norm by its lowest-ranked holder only (``uncounted`` lists the other copies here).
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
        held = dict(local.named_parameters(remove_duplicate=False))
        by_holders: dict[tuple[int, ...], list[nn.Parameter]] = {}
        self.uncounted: set[int] = set()
        for names in tied:
            ranks = holders(plan, names, layout)
            param = next((held[n] for n in names if n in held), None)
            by_holders.setdefault(ranks, [])
            if rank in ranks:
                assert param is not None, f"rank {rank} should hold {names[0]}"
                by_holders[ranks].append(param)
                if rank != ranks[0]:
                    self.uncounted.add(id(param))
        self.buckets: list[tuple[tuple[int, ...], dist.ProcessGroup, list[nn.Parameter]]] = []
        for ranks in sorted(by_holders):  # every rank makes every group, in the same order
            if len(ranks) > 1:
                group = dist.new_group(list(ranks))
                if rank in ranks:
                    self.buckets += [(ranks, group, bucket) for bucket in _buckets(by_holders[ranks])]

    @torch.no_grad()
    def sync(self) -> None:
        """Average this rank's gradients with their other holders (call after every backward)."""
        for ranks, group, params in self.buckets:  # the same order on every rank: no cross waits
            for p in params:
                if p.grad is None:  # an unused parameter still takes part, so the collectives match
                    p.grad = torch.zeros_like(p)
            grads = [p.grad for p in params]
            if self.before_reduce is not None:
                self.before_reduce(ranks, sum(g.numel() * g.element_size() for g in grads))  # type: ignore[union-attr]
            sum_flat_(grads, group, divisor=self.replicas)  # type: ignore[arg-type]


def _buckets(params: list[nn.Parameter]) -> list[list[nn.Parameter]]:
    """``params`` in order, cut into runs of at most :data:`BUCKET_BYTES` (one parameter may exceed it alone)."""
    out: list[list[nn.Parameter]] = [[]]
    size = 0
    for p in params:
        nbytes = p.numel() * p.element_size()
        if out[-1] and size + nbytes > BUCKET_BYTES:
            out.append([])
            size = 0
        out[-1].append(p)
        size += nbytes
    return [b for b in out if b]
