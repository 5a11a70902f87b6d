"""Replicas whose pipelines differ in depth (``Plan.replicas``): their search (their layout type
is :class:`~tessera.planner.layout.MixedLayout`, their cost :func:`~tessera.planner.costmodel.mixed_estimate`).

The grid planner gives every replica the same stages. Here each *pool* (a run of alike devices
next to each other in one node, in cluster-file order) is cut into replicas of its own depth:
a fast 80 GiB device can hold every layer alone while small-memory ones pair up as two-stage
pipelines (the shape Zorse argues for). Ranks follow the cluster file, so every such plan is
launchable by torchrun as it stands.

Cost. A replica of depth d is costed as a one-replica :class:`Layout` (pp = d) by the same
functions as the grid: ``pipeline_s``, ``device_memory``, ``optimizer_s``. The
runtime averages each layer's gradient over the ranks that hold it once every pipeline is done,
so the step is::

    step = max_r ( pipeline_r + optimizer_r ) + sync,
    sync = each group of gradient holders' all-reduce over its own slowest link (replica_sync_s)

(the slowest optimizer is counted with its own replica, not after every replica's pipeline: a
small optimism that keeps replicas independent given their micro-batch sizes).

Search. Given its micro-batch size each replica takes its fastest layer split that fits, so
its time is an increasing function of that size and the greedy share rule of
:mod:`tessera.planner.search` is exact again. Depths are enumerated per pool (every divisor of
the pool's size) when there are at most :data:`DEPTH_LIMIT` combinations, else each pool takes
the smallest depth that fits.

Example:
    >>> found = list(mixed_candidates(cluster, costs, global_batch=32, counts=(2, 4)))
"""

from __future__ import annotations

import bisect
import heapq
import itertools
import math
from collections.abc import Iterator
from dataclasses import dataclass

from tessera.cluster.spec import Cluster, Link
from tessera.plan import PipelineSpec, Plan, Replica
from tessera.planner.bounds import pipelines_floor
from tessera.planner.costmodel import (
    INFEASIBLE,
    device_memory,
    pipeline_s,
    replica_optimizer_s,
    replica_sync_floor,
    replica_sync_s,
)
from tessera.planner.costs import ModelCosts
from tessera.planner.layout import (
    Layout,
    MixedLayout,
    OpTimes,
    ReplicaSpec,
    UnitSpec,
    stage_pass_s,
    sync_groups,
    transfers_line,
    transfers_s,
    unit_of,
)
from tessera.planner.space import proportional_split, splits

DEPTH_LIMIT = 64  # shape combinations enumerated; above it, per kind of pool, then each pool's smallest
TP_DEGREES = (2, 4, 8)  # a replica's tp inside one node, as the grid's
MAX_DEVICES = 64  # larger clusters are planned on the grid only (search time)
SPLIT_LIMIT = 200
RECOMPUTE = ("none", "full")


@dataclass(frozen=True)
class Pool:
    """Alike devices next to each other in one node (cluster-file indices), and their unit."""

    devices: tuple[int, ...]
    unit: UnitSpec
    link: Link  # inside the node: between a replica's stages


def pools(cluster: Cluster, dtype: str) -> list[Pool]:
    """Runs of same-type devices inside each node, in cluster-file order."""
    devices = cluster.devices()
    out: list[Pool] = []
    run: list[int] = []
    for i, (node, _, kind) in enumerate(devices):
        if run and (devices[run[-1]][0] != node or devices[run[-1]][2].name != kind.name):
            out.append(_pool(cluster, run, dtype))
            run = []
        run.append(i)
    if run:
        out.append(_pool(cluster, run, dtype))
    return out


def _pool(cluster: Cluster, run: list[int], dtype: str) -> Pool:
    devices = cluster.devices()
    node = devices[run[0]][0]
    return Pool(tuple(run), unit_of(cluster, [devices[run[0]]], dtype), cluster.link(node, node))


class _Kind:
    """One pool's replicas at one depth (or one tp degree): each layer split's optimizer step, and its pipeline
    time per micro-batch."""

    def __init__(
        self, costs, pool: Pool, shape: tuple[int, int], m: int, schedule: str, recompute: str, r: int, link: Link
    ):
        self.costs, self.pool = costs, pool
        self.depth, self.tp = shape
        self.args = (m, schedule, recompute, r, link)
        n_splits = math.comb(costs.n_layers - 1, self.depth - 1)
        self.splits = (
            list(splits(costs.n_layers, self.depth))
            if n_splits <= SPLIT_LIMIT
            else [proportional_split(costs, [1.0] * self.depth)]
        )
        self.optimizer = {st: replica_optimizer_s(self.view(st, 1), costs) for st in self.splits}  # not in b
        self._pipe: dict[tuple[tuple, int], float] = {}
        self._stages: dict[tuple[int, int, int, int], tuple[bool, tuple[float, float]]] = {}
        self._transfers: dict[int, tuple[tuple[float, ...], tuple[float, ...]]] = {}
        self._by_optimizer = sorted(self.splits, key=lambda st: self.optimizer[st])
        self._caps = [self.optimizer[st] for st in self._by_optimizer]
        self._best: dict[int, list[tuple[float, tuple]]] = {}  # per b: the running best in optimizer order

    def view(self, stages, b: int) -> Layout:
        """This replica as a one-replica Layout with ``stages`` and micro-batch ``b``."""
        m, schedule, recompute, r, link = self.args
        d = len(stages)
        spec = ReplicaSpec(1, (self.pool.unit,) * d, (self.pool.link,) * (d - 1), b)
        return Layout(d, r, self.tp, stages, m, schedule, 0, False, recompute, (spec,), (link,) * d, grads_freed=True)

    def pipeline(self, stages, b: int) -> float:
        """Pipeline seconds with ``stages`` at micro-batch ``b`` (inf: a stage runs out of memory)."""
        key = (stages, b)
        if key not in self._pipe:
            view = self.view(stages, b)
            spec = view.replicas[0]
            # a stage's memory and passes depend on its own layers, place and b alone: splits share them
            if any(not self._stage(view, spec, s)[0] for s in range(self.depth)):
                self._pipe[key] = INFEASIBLE
            else:
                if b not in self._transfers:
                    self._transfers[b] = transfers_s(self.costs, spec.p2p, b)
                passes = [self._stage(view, spec, s)[1] for s in range(self.depth)]
                times = OpTimes(tuple(f for f, _ in passes), tuple(w for _, w in passes), *self._transfers[b])
                self._pipe[key] = pipeline_s(times, view.microbatches, view.schedule)
        return self._pipe[key]

    def _stage(self, view: Layout, spec: ReplicaSpec, s: int) -> tuple[bool, tuple[float, float]]:
        """(whether stage ``s`` fits, its (forward, backward) seconds) at the view's micro-batch."""
        first, end = view.stages[s]
        key = (s, first, end, spec.micro_batch)
        if key not in self._stages:
            fits = sum(device_memory(view, self.costs, spec, s)) <= self.pool.unit.memory_bytes
            self._stages[key] = (fits, stage_pass_s(view, self.costs, first, end, spec.units[s], spec.micro_batch))
        return self._stages[key]

    def best(self, b: int, cap: float) -> tuple[float, tuple]:
        """(pipeline seconds, stages) of the fastest split that fits at ``b`` with an optimizer step ≤ ``cap``.

        Per ``b``, the splits in order of optimizer step with the running best: every cap is then a
        bisection (the greedy asks for each cap in turn, and scanning every split each time was
        most of the planner's time on clusters of many small pools)."""
        i = bisect.bisect_right(self._caps, cap)
        if not i:
            return (INFEASIBLE, self.splits[0])
        running = self._best.setdefault(b, [])
        for st in self._by_optimizer[len(running) : i]:  # only the splits a cap has asked for, once each
            running.append(min(running[-1] if running else (INFEASIBLE, self.splits[0]), (self.pipeline(st, b), st)))
        return running[i - 1]


def _shapes(pool: Pool, costs: ModelCosts) -> list[tuple[int, int]]:
    """A pool's replica shapes (depth, tp): pipelines of every depth dividing its size, and whole models split
    over tp devices (tp dividing its size and the model's heads)."""
    n = len(pool.devices)
    depths = [(d, 1) for d in range(1, min(n, costs.n_layers) + 1) if n % d == 0]
    return depths + [(1, t) for t in TP_DEGREES if t <= n and n % t == 0 and costs.heads % t == 0]


def depth_choices(costs: ModelCosts, all_pools: list[Pool], m: int) -> Iterator[tuple[tuple[int, int], ...]]:
    """A replica shape (depth, tp) per pool: every combination; or, when there are too many, every shape per
    kind of pool (alike pools alike); or (still too many) each pool's smallest depth whose replicas fit at
    micro-batch 1, and beside it each pool's smallest tp that fits."""
    per_pool = [_shapes(p, costs) for p in all_pools]
    if math.prod(len(c) for c in per_pool) <= DEPTH_LIMIT:
        yield from itertools.product(*per_pool)
        return
    kinds = list(dict.fromkeys(_alike(p) for p in all_pools))
    per_kind = [_shapes(next(p for p in all_pools if _alike(p) == k), costs) for k in kinds]
    if math.prod(len(c) for c in per_kind) <= DEPTH_LIMIT:
        for chosen in itertools.product(*per_kind):
            by_kind = dict(zip(kinds, chosen))
            yield tuple(by_kind[_alike(p)] for p in all_pools)
        return
    for split in ("depth", "tp"):
        smallest = []
        for pool, choices in zip(all_pools, per_pool):
            tried = [c for c in choices if c[1] == 1] if split == "depth" else [c for c in choices if c[0] == 1]
            fit = next((c for c in tried if _fits(costs, pool, c, m)), None)
            if fit is None:
                break
            smallest.append(fit)
        else:
            yield tuple(smallest)


def _alike(pool: Pool) -> tuple:
    return (pool.unit, len(pool.devices), pool.link)


def _fits(costs: ModelCosts, pool: Pool, shape: tuple[int, int], m: int) -> bool:
    return _Kind(costs, pool, shape, m, "gpipe", "full", 2, pool.link).best(1, INFEASIBLE)[0] < INFEASIBLE


@dataclass
class _Option:
    """One depth per pool, micro-batch count and recompute: its replicas, and the best shares and splits."""

    kinds: list[_Kind]  # one per replica (replicas of one pool and depth share the object)
    sync_floor: float  # no layer split syncs faster (the sync itself depends on the splits the shares pick)

    def floor(self, costs: ModelCosts, global_batch: int, m: int) -> float:
        """No shares or splits make this option's step shorter (:func:`~tessera.planner.bounds.pipelines_floor`,
        then the sync)."""
        kinds, transfers = [], []
        for kind in dict.fromkeys(self.kinds):  # each kind once, with its replica count
            # a tp group at best computes tp times as fast as one device (its collectives cost more)
            kinds.append((self.kinds.count(kind), [kind.pool.unit.peak_tflops * kind.tp] * kind.depth))
            transfers.append(transfers_line(costs, (kind.pool.link,) * (kind.depth - 1)))
        return pipelines_floor(costs, kinds, transfers, 1, m, global_batch) + self.sync_floor

    def shares(
        self, total: int, exhaustive: bool, beaten: float | None = None
    ) -> tuple[float, list[int], list[tuple]] | None:
        """(step without the sync, micro-batch size per replica summing to ``total``, split per replica), or
        None if nothing fits.

        The step without the sync is ``max pipeline + max optimizer``. For each cap on the optimizer step
        (every split's is a candidate) each replica's best time is increasing in its micro-batch,
        so the greedy is exact under that cap; the best over caps is the optimum. ``exhaustive``
        tries every share vector and every split of every replica instead. Given ``beaten``, the greedy stops
        once its step without the sync must be above it (None then if no cap did better)."""
        if total < len(self.kinds):
            return None
        return self._every(total) if exhaustive else self._greedy(total, INFEASIBLE if beaten is None else beaten)

    def _greedy(self, total: int, beaten: float) -> tuple[float, list[int], list[tuple]] | None:
        best = None
        # every replica's optimizer step is at least its kind's fastest: the step is at least a pipeline popped
        # (the max only grows as replicas take more) plus the largest of those
        optimizer_floor = max(min(k.optimizer.values()) for k in self.kinds)
        for cap in sorted({t for k in self.kinds for t in k.optimizer.values()}):
            if cap < optimizer_floor:
                continue  # some replica has no split this fast: nothing fits under this cap
            limit = beaten if best is None else min(beaten, best[0])
            sizes = [1] * len(self.kinds)
            heap = [(k.best(2, cap)[0], i) for i, k in enumerate(self.kinds)]
            heapq.heapify(heap)
            for _ in range(total - len(sizes)):
                t, i = heapq.heappop(heap)
                if t == INFEASIBLE or t + optimizer_floor > limit:
                    break
                sizes[i] += 1
                heapq.heappush(heap, (self.kinds[i].best(sizes[i] + 1, cap)[0], i))
            else:
                chosen = [k.best(b, cap) for k, b in zip(self.kinds, sizes)]
                stages = [st for _, st in chosen]
                step = max(t for t, _ in chosen) + max(k.optimizer[st] for k, st in zip(self.kinds, stages))
                if step < INFEASIBLE and (best is None or step < best[0]):
                    best = (step, sizes, stages)
        return best

    def _every(self, total: int) -> tuple[float, list[int], list[tuple]] | None:
        best = None
        for cuts in itertools.combinations(range(1, total), len(self.kinds) - 1):
            bounds = (0, *cuts, total)
            sizes = [b - a for a, b in zip(bounds[:-1], bounds[1:])]
            for stages in itertools.product(*(k.splits for k in self.kinds)):
                pipe = max(k.pipeline(st, b) for k, st, b in zip(self.kinds, stages, sizes))
                step = pipe + max(k.optimizer[st] for k, st in zip(self.kinds, stages))
                if step < INFEASIBLE and (best is None or step < best[0]):
                    best = (step, sizes, list(stages))
        return best


def mixed_candidates(
    cluster: Cluster, costs: ModelCosts, global_batch: int, counts: tuple[int, ...], exhaustive: bool = False,
    beaten: float | None = None,
) -> Iterator[tuple[float, Plan, MixedLayout, str]]:  # fmt: skip
    """(step, Plan, MixedLayout, label) of the best shares for every depth choice, micro-batch count and
    recompute; nothing on clusters over :data:`MAX_DEVICES` devices, nor where every pool has depth 1 (the
    grid's DDP with uneven shares is that layout). A choice whose floor (its pipelines' and its sync) is above
    ``beaten`` is skipped unjudged."""
    if cluster.world_size > MAX_DEVICES:
        return
    all_pools = pools(cluster, costs.precision)
    devices = cluster.devices()
    link = cluster.worst_link({devices[i][0] for i in range(len(devices))})
    for m in counts:
        for depths in depth_choices(costs, all_pools, m):
            if max(d * t for d, t in depths) == 1:  # every replica one device: the grid's DDP with uneven shares,
                continue  # which DDP runs (the replicas engine ran the same layout 3 % slower on the testbed)
            r = sum(len(p.devices) // (d * t) for p, (d, t) in zip(all_pools, depths))
            if r < 2 or global_batch // m < r:
                continue  # one replica: the grid's plain pipeline
            schedule = "1f1b" if m >= max(d for d, _ in depths) else "gpipe"
            for recompute in RECOMPUTE:
                kinds = []
                for pool, shape in zip(all_pools, depths):
                    kind = _Kind(costs, pool, shape, m, schedule, recompute, r, link)
                    kinds += [kind] * (len(pool.devices) // (shape[0] * shape[1]))
                most = max(k.depth * k.tp for k in kinds)
                option = _Option(kinds, replica_sync_floor(costs, link, r, most))
                if beaten is not None and option.floor(costs, global_batch, m) > beaten:
                    continue
                found = option.shares(
                    global_batch // m, exhaustive, None if beaten is None else beaten - option.sync_floor
                )
                if found is not None:
                    step, sizes, stages = found
                    plan, layout = _plan(cluster, costs, all_pools, kinds, sizes, stages)
                    yield step + replica_sync_s(layout.sync_groups), plan, layout, _label(all_pools, depths)


def _label(all_pools: list[Pool], shapes: tuple[tuple[int, int], ...]) -> str:
    return "mixed depths: " + " + ".join(
        f"{len(p.devices) // (d * t)}x{p.unit.device} " + (f"tp{t}" if t > 1 else f"depth {d}")
        for p, (d, t) in zip(all_pools, shapes)
    )


def _plan(cluster, costs, all_pools, kinds, sizes, stage_splits) -> tuple[Plan, MixedLayout]:
    m, schedule, recompute = kinds[0].args[:3]
    replicas, parts, placed = [], [], []
    devices = iter(d for p in all_pools for d in p.devices)
    for kind, b, stages in zip(kinds, sizes, stage_splits):
        replicas.append(Replica(stages, share=b * m, tp=kind.tp))
        parts.append(kind.view(stages, b))
        placed.append(tuple(next(devices) for _ in range(kind.depth * kind.tp)))
    names = cluster.devices()
    plan = Plan(
        replicas=tuple(replicas),
        pipeline=PipelineSpec(microbatches=m, schedule=schedule),
        precision=costs.precision,
        recompute=recompute,
        rank_devices=tuple(f"{names[d][0]}:{names[d][1]}:{names[d][2].name}" for group in placed for d in group),
    )
    return plan, MixedLayout(tuple(parts), sync_groups(tuple(parts), tuple(placed), cluster, costs), tuple(placed))
