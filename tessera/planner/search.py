"""The planner's search: the fastest Plans for a model on a cluster, judged by the cost model.

The space (everything the runtime executes): tensor-parallel degree (groups inside one node),
pipeline and data-parallel degrees, which devices sit at each (stage, replica) of the mesh,
the layer range of every stage, the samples each replica takes (uneven: a slow replica takes
fewer), micro-batch count, ZeRO stage, offload and activation recompute.

How it is searched, one level at a time:

1. ``tp × pp × dp`` over the degrees that divide the cluster (tp ≤ the model's heads and
   inside a node; pp ≤ layers; dp ≤ the global batch).
2. Device placement. Replicas are interchangeable, so placements are counted up to a
   reordering of replicas; when there are few (small clusters) every one is tried, else the
   canonical ones: devices sorted fast-first or slow-first, grouped by region, filling stages
   first (each stage's group alike: the layer split follows speed) or replicas first (each
   replica's pipeline alike: the shares follow speed).
3. Layer split: every split when there are few, else a split in proportion to each stage's
   speed, improved by moving one boundary at a time while the step gets faster (which also
   moves layers off a stage that would run out of memory).
4. Shares: the step is the slowest replica's time, each replica's time grows with its
   micro-batch, so handing out samples one micro-batch at a time to the replica that would
   finish soonest is optimal (the greedy is exact for a min–max of increasing functions).
5. ZeRO stage, offload, recompute and micro-batch count: each combination, best kept.
6. Beside the grid: replicas whose pipelines differ in depth, one depth per pool of alike
   devices (:mod:`tessera.planner.mixed`), judged by the same cost functions.

Families (tp, pp, dp, micro-batch count), their placements and, where every split is tried, their splits
are judged most promising first, and skipped once the top plans are found if their floor under the cost
model's step (:mod:`tessera.planner.bounds`) is above the last of them: only what could not enter the top
is skipped. Enumerating placements spends a budget that all families share.

:func:`exhaustive_search` tries every placement, split and share vector instead; tests and the
regret benchmark hold the planner to it.

Example:
    >>> best = search(cluster, costs, global_batch=64, top=3)
    >>> best[0].plan, best[0].estimate.step_s, best[0].estimate.bottleneck
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from functools import cached_property

from tessera.cluster.spec import Cluster, Link
from tessera.errors import PlanError
from tessera.plan import PipelineSpec, Plan, grid_order
from tessera.planner.bounds import over_shares, pipelines_floor, step_floor, sync_floor
from tessera.planner.costmodel import INFEASIBLE, Estimate, device_memory, estimate, fits, stage_finish_s, step_time
from tessera.planner.costs import ModelCosts
from tessera.planner.layout import (
    MAX_TREE_RANKS,
    Layout,
    MixedLayout,
    OpTimes,
    ReplicaSpec,
    UnitSpec,
    grad_sync_s,
    links_among,
    optimizer_s,
    pipeline_links,
    stage_pass_s,
    transfers_line,
    transfers_s,
)
from tessera.planner.mixed import mixed_candidates
from tessera.planner.space import (
    PLACEMENT_LIMIT,
    Grid,
    Options,
    degrees,
    grids,
    option_sets,
    placements,
    proportional_split,
    splits,
    units_of,
)

# Below these counts the search enumerates instead of using heuristics.
EXACT_BUDGET = 1_000_000  # share searches the whole search may spend on enumerating placements
SPLIT_LIMIT = 200
MAX_MOVES = 8  # one-layer moves from the proportional split, on large clusters


@dataclass(frozen=True)
class Candidate:
    """One planned layout: the Plan to run, its Layout and the cost model's estimate."""

    plan: Plan
    layout: Layout | MixedLayout
    estimate: Estimate
    placement: str  # how devices were placed, in words
    notes: tuple[str, ...] = ()  # what the user should know (e.g. the precision chosen and why)


# ----------------------------------------------------------- one placement
@dataclass(frozen=True)
class _Placed:
    """A placement, worked out once: its replicas grouped into kinds, and each stage's dp link."""

    label: str
    grid: Grid
    kinds: tuple[tuple[tuple[UnitSpec, ...], tuple[Link, ...], tuple[int, ...]], ...]  # (units, p2p, replicas)
    dp_links: tuple[Link, ...]
    kind_of: tuple[int, ...]  # each replica's kind
    dp_groups: tuple[tuple[str, ...], ...] = ()  # per stage, each dp rank's node: for gloo's ZeRO-1 broadcasts
    node_links: tuple = ()  # the links among those nodes

    @classmethod
    def of(cls, cluster: Cluster, label: str, grid: Grid) -> _Placed:
        pp, dp = len(grid), len(grid[0])
        kinds: dict[tuple, list[int]] = {}
        columns = [tuple(grid[s][r] for s in range(pp)) for r in range(dp)]
        p2p = pipeline_links(cluster, [tuple(u.node for u in column) for column in columns])
        for r, column in enumerate(columns):
            kinds.setdefault((tuple(u.spec for u in column), p2p[r]), []).append(r)
        dp_links = tuple(cluster.worst_link({u.node for u in row}) for row in grid)
        kind_of = [0] * dp
        for k, replicas in enumerate(kinds.values()):
            for r in replicas:
                kind_of[r] = k
        groups: tuple[tuple[str, ...], ...] = ()
        if any(link.backend == "gloo" for link in dp_links) and dp <= MAX_TREE_RANKS:  # CPU clusters: small
            groups = tuple(tuple(u.node for u in row) for row in grid)
        kinds_ = tuple((*k, tuple(rs)) for k, rs in kinds.items())
        return cls(label, grid, kinds_, dp_links, tuple(kind_of), groups, links_among(cluster, groups))


class _Evaluator:
    """Step time of one (placement, layer split, micro-batch count, options) as shares vary."""

    def __init__(
        self, placed: _Placed, costs: ModelCosts, tp: int, m: int, stages, options: Options, memo: dict | None = None
    ):
        pp, dp = len(placed.grid), len(placed.grid[0])
        self.costs, self.placed = costs, placed
        self.memo = {} if memo is None else memo  # what placements share, shared by a search's evaluators
        self.base = Layout(
            pp, dp, tp, stages, m, "1f1b" if m >= pp else "gpipe", options.zero, options.offload, options.recompute,
            (), placed.dp_links, node_links=placed.node_links, dp_groups=placed.dp_groups,
        )  # fmt: skip
        self._cache: dict[tuple[int, int], float] = {}
        self._memory = [self._stage_memory(s) for s in range(pp)]
        self._ops: dict[int, list[tuple[float, float]]] = {}
        self._tail: list[float] | None = None
        self._max_b: dict[int, float] = {}
        self.too_slow = False  # a share search stopped because its step would be above the bound it was given

    def _stage_memory(self, stage: int) -> tuple[float, float]:
        """A stage's bytes a device as (fixed, per-sample): affine in the micro-batch, and the units do not
        matter, so one placement's figures serve all placements of this shape, split and options."""
        base = self.base
        key = ("memory", base.pp, base.dp, base.tp, base.microbatches, base.zero, base.offload, base.recompute, stage,
               base.stages[stage])  # fmt: skip
        if key not in self.memo:
            fixed, one = (sum(device_memory(base, self.costs, self.replica(0, b), stage)) for b in (0, 1))
            self.memo[key] = (fixed, one - fixed)
        return self.memo[key]

    @property
    def tail(self) -> list[float]:
        """After the slowest replica of each stage: its sync, then the slowest optimizer step of the stage
        (every replica's, whatever its share: so the greedy shares below stay exact). Worked out once a
        micro-batch fits: most evaluators the search builds run out of memory first."""
        if self._tail is None:
            base, kinds = self.base, self.placed.kinds
            self._tail = [
                grad_sync_s(base, self.costs, s)
                + max(optimizer_s(base, self.costs, s, units[s]) for units, _, _ in kinds)
                for s in range(base.pp)
            ]
        return self._tail

    def _stage_pass(self, stage: tuple[int, int], unit: UnitSpec) -> tuple[tuple[float, float], tuple[float, float]]:
        """(forward, backward) of a stage as (fixed, per-sample) seconds, from ``stage_pass_s`` at 1 and 2."""
        base = self.base
        key = (base.tp, base.zero >= 2, base.recompute, stage, unit)
        if key not in self.memo:
            one, two = (stage_pass_s(base, self.costs, *stage, unit, n) for n in (1, 2))
            self.memo[key] = tuple((2 * x - y, y - x) for x, y in zip(one, two))
        return self.memo[key]

    def replica(self, kind: int, b: int, count: int = 1) -> ReplicaSpec:
        units, p2p, _ = self.placed.kinds[kind]
        return ReplicaSpec(count, units, p2p, b)

    def memory_ratio(self, kind: int, b: int) -> list[float]:
        """Each stage's predicted memory over its usable memory, for this kind of replica."""
        units = self.placed.kinds[kind][0]
        return [(fixed + b * slope) / u.memory_bytes for (fixed, slope), u in zip(self._memory, units)]

    def max_micro_batch(self, kind: int) -> float:
        """The largest micro-batch this kind's devices hold (memory is affine in it)."""
        if kind not in self._max_b:
            units = self.placed.kinds[kind][0]
            self._max_b[kind] = min(
                (u.memory_bytes - fixed) / slope if slope > 0 else (INFEASIBLE if fixed <= u.memory_bytes else -1.0)
                for (fixed, slope), u in zip(self._memory, units)
            )
        return self._max_b[kind]

    def op_times(self, kind: int, b: int) -> OpTimes:
        """Per-stage seconds of one micro-batch of ``b``: affine in ``b``, so worked out once per kind (each
        stage's from the search's memo: placements, splits and options share most stages)."""
        if kind not in self._ops:
            units, p2p, _ = self.placed.kinds[kind]
            passes = [self._stage_pass(stage, unit) for stage, unit in zip(self.base.stages, units)]
            one, two = (transfers_s(self.costs, p2p, n) for n in (1, 2))
            links = [(2 * x - y, y - x) for x, y in zip((*one[0], *one[1]), (*two[0], *two[1]))]
            self._ops[kind] = [f for f, _ in passes] + [bwd for _, bwd in passes] + links
        values = [fixed + b * slope for fixed, slope in self._ops[kind]]
        pp = self.base.pp
        boundaries = (len(values) - 2 * pp) // 2
        transfer, latency = values[2 * pp : 2 * pp + boundaries], values[2 * pp + boundaries :]
        return OpTimes(tuple(values[:pp]), tuple(values[pp : 2 * pp]), tuple(transfer), tuple(latency))

    def holds(self, units_total: int) -> bool:
        """Whether the replicas hold ``units_total`` samples a micro-batch between them, one at least each:
        the greedy in :meth:`shares` runs out of memory exactly when they do not (no timing needed)."""
        most = [min(self.max_micro_batch(k), units_total) for k in range(len(self.placed.kinds))]
        room = sum(len(rs) * math.floor(b) for b, (_, _, rs) in zip(most, self.placed.kinds))
        return units_total >= self.base.dp and min(most) >= 1 and room >= units_total

    def floor(self, units_total: int) -> float:
        """No shares make this evaluator's step shorter: each replica's pipeline is at least two lines in its
        micro-batch b (m × its busiest stage's pass; the fill, transfers and m − 1 more of that stage: see
        :mod:`~tessera.planner.bounds`), whose average over the replicas weighted by 1/slope no shares beat;
        then stage 0's sync and optimizer step."""
        m, pp = self.base.microbatches, self.base.pp
        busy_lines, paced_lines = [], []
        for kind, (_, _, replicas) in enumerate(self.placed.kinds):
            self.op_times(kind, 1)  # fills the (fixed, per-sample) coefficients
            ops = self._ops[kind]
            passes = [(f[0] + b[0], f[1] + b[1]) for f, b in zip(ops[:pp], ops[pp : 2 * pp])]
            busiest = max(passes, key=lambda line: line[0] + line[1] * units_total / self.base.dp)
            total = (sum(f for f, _ in passes), sum(s for _, s in passes))
            if m != pp or self.base.schedule == "gpipe":
                moved = ops[2 * pp : 2 * pp + pp - 1]
                fill = (total[0] + 2 * sum(f for f, _ in moved), total[1] + 2 * sum(s for _, s in moved))
            else:  # 1f1b with m = pp: a 1/pp share of the fill, no transfers
                fill = (total[0] / pp, total[1] / pp)
            busy_lines += [(m * busiest[0], m * busiest[1])] * len(replicas)
            paced_lines += [(fill[0] + (m - 1) * busiest[0], fill[1] + (m - 1) * busiest[1])] * len(replicas)
        pipelines = max(over_shares(lines, units_total) for lines in (busy_lines, paced_lines))
        return pipelines + self.tail[0]

    def time(self, kind: int, b: int) -> float:
        """Step time if this kind's replicas ran micro-batches of ``b`` (inf: out of memory)."""
        key = (kind, b)
        if key not in self._cache:
            if b > self.max_micro_batch(kind):
                self._cache[key] = INFEASIBLE
            else:
                finish = stage_finish_s(self.op_times(kind, b), self.base.microbatches, self.base.schedule)
                self._cache[key] = max(f + t for f, t in zip(finish, self.tail))
        return self._cache[key]

    def shares(self, units_total: int, beaten: float | None = None) -> tuple[float, list[int]] | None:
        """Greedy micro-batch sizes per replica summing to ``units_total``; (step, sizes) or None if nothing fits
        (or, given ``beaten``, once the step must exceed it: each replica's time only grows as it takes more,
        so the step is at least every time popped)."""
        dp = self.base.dp
        if not self.holds(units_total):
            return None
        if len(self.placed.kinds) == 1:  # alike replicas: the greedy deals the samples round, low ranks first
            size = [units_total // dp + (r < units_total % dp) for r in range(dp)]
            step = max(self.time(0, b) for b in set(size))
            if step == INFEASIBLE:
                return None
            if beaten is not None and step > beaten:
                self.too_slow = True
                return None
            return step, size
        size = [1] * dp
        heap = [(self.time(k, 2), k, r) for k, (_, _, rs) in enumerate(self.placed.kinds) for r in rs]
        heapq.heapify(heap)
        limit = INFEASIBLE if beaten is None else beaten
        for _ in range(units_total - dp):
            t, k, r = heapq.heappop(heap)
            if t == INFEASIBLE:
                return None
            if t > limit:
                self.too_slow = True
                return None
            size[r] += 1
            heapq.heappush(heap, (self.time(k, size[r] + 1), k, r))
        kind_of = self.placed.kind_of
        return max(self.time(kind_of[r], size[r]) for r in range(dp)), size

    def layout(self, sizes: list[int]) -> Layout:
        kind_of = self.placed.kind_of
        groups: dict[tuple[int, int], int] = {}
        for r, b in enumerate(sizes):
            groups[(kind_of[r], b)] = groups.get((kind_of[r], b), 0) + 1
        replicas = tuple(self.replica(k, b, n) for (k, b), n in sorted(groups.items()))
        return replace(self.base, replicas=replicas)


# -------------------------------------------------------------------- search
def search(
    cluster: Cluster,
    costs: ModelCosts,
    global_batch: int,
    top: int = 5,
    microbatches: tuple[int, ...] = (1, 2, 4, 8, 16, 32),
    placement_limit: int = PLACEMENT_LIMIT,
    split_limit: int = SPLIT_LIMIT,
    budget: int = EXACT_BUDGET,
    mixed: bool = True,
) -> list[Candidate]:
    """The ``top`` fastest Plans that fit in memory, fastest first (see the module docstring); with ``mixed``
    False, grid layouts only (no replicas of different depth).

    Where placements are enumerated (small clusters) every option and every layer split is
    tried, so the result is the optimum under the cost model. Elsewhere the options are tried
    from fastest to most frugal and the first that fits is kept, and splits are improved
    from a proportional one.
    """
    _check_batch(cluster, costs, global_batch)
    best: dict[tuple, tuple[float, tuple, object]] = {}  # the best plan of each shape (degrees, placement, m)
    counter, memo = itertools.count(), {}
    families = []  # (floor, degrees' index, tp, pp, dp, units, {m: floor}): the most promising judged first
    for index, (tp, pp, dp) in enumerate(degrees(cluster, costs, global_batch)):
        units = units_of(cluster, tp, costs.precision)
        if units is None:
            continue
        counts = [m for m in microbatches if global_batch % m == 0 and global_batch // m >= dp]
        floors = {m: step_floor(cluster, units, costs, tp, pp, dp, m, global_batch) for m in counts}
        families.append((min(floors.values(), default=INFEASIBLE), index, tp, pp, dp, units, floors))
    spent = 0  # share searches spent on enumerated placements: what a family leaves, later ones may use
    for left, (_, index, tp, pp, dp, units, floors) in enumerate(sorted(families, key=lambda f: f[:2])):
        if (beaten := _top_step(best, top)) is not None and min(floors.values(), default=INFEASIBLE) > beaten:
            break  # sorted by floor: no family left can reach the top
        counts = list(floors)
        n_splits = math.comb(costs.n_layers - 1, pp - 1)
        tried_splits = n_splits if n_splits <= split_limit else 1 + 2 * MAX_MOVES  # every one, or a walk
        per_placement = max(1, len(counts) * len(option_sets(dp, pp, tp)) * tried_splits)
        tried = []  # (floor, placement's index, placement, {m: floor}): the most promising judged first
        limit = min(placement_limit, (budget - spent) // (len(families) - left) // per_placement)  # shared budget
        for i, (label, grid) in enumerate(placements(units, pp, dp, limit)):
            placed = _Placed.of(cluster, label, grid)
            own = {m: max(floors[m], _placement_floor(placed, costs, tp, m, global_batch)) for m in counts}
            tried.append((min(own.values(), default=INFEASIBLE), i, placed, own))
        for _, i, placed, own in sorted(tried, key=lambda t: t[:2]):
            exact = placed.label == "enumerated"
            shape = tuple(tuple(u.devices for u in row) for row in placed.grid)
            for m in counts:
                if (beaten := _top_step(best, top)) is not None and own[m] > beaten:
                    continue
                spent += per_placement // len(counts) if exact else 0  # judged: skipped ones cost next to nothing
                for options in option_sets(dp, pp, tp):
                    beaten = _top_step(best, top)
                    found, pruned = _best_splits(
                        costs, placed, tp, m, options, global_batch // m, split_limit, memo, beaten, exact
                    )
                    for step, sizes, ev in found:
                        entry = (step, (index, i, next(counter)), (ev, sizes))  # ties: the earlier, simpler one
                        if (shape, m) not in best or entry < best[(shape, m)]:
                            best[(shape, m)] = entry
                    if (found or pruned) and not exact:
                        break  # options run from fastest to most frugal: the first that fits wins
    counts = tuple(m for m in microbatches if global_batch % m == 0)
    beaten = _top_step(best, top)
    for step, plan, layout, label in (
        mixed_candidates(cluster, costs, global_batch, counts, beaten=beaten) if mixed else ()
    ):
        key = ("mixed", label, plan.pipeline.microbatches)
        entry = (step, (len(families), 0, next(counter)), (plan, layout, label))
        if key not in best or entry < best[key]:
            best[key] = entry
    if not best:
        raise PlanError(
            f"no plan fits: every layout of this model on the cluster's {cluster.world_size} devices runs out of "
            "memory even with ZeRO-3, offload and full recompute; add devices or memory, or shrink the model."
        )
    ranked = heapq.nsmallest(top, best.values(), key=lambda e: e[:2])
    return [_candidate(cluster, costs, *payload) for _, _, payload in ranked]


def _placement_floor(placed: _Placed, costs: ModelCosts, tp: int, m: int, global_batch: int) -> float:
    """The floor of one placement: its replicas' pipelines (:func:`~tessera.planner.bounds.pipelines_floor`,
    transfers affine in the micro-batch as the evaluator takes them), then stage 0's sync over its own link."""
    kinds, transfers = [], []
    for units, p2p, replicas in placed.kinds:
        kinds.append((len(replicas), [u.peak_tflops for u in units]))
        transfers.append(transfers_line(costs, p2p))
    pp, dp = len(placed.grid), len(placed.grid[0])
    pipelines = pipelines_floor(costs, kinds, transfers, tp, m, global_batch)
    return pipelines + sync_floor(costs, tp, pp, dp, m, [placed.dp_links[0]])


def _top_step(best: dict, top: int) -> float | None:
    """The step a plan must beat to enter the ``top`` found so far (None: fewer found)."""
    if len(best) < top:
        return None
    return heapq.nsmallest(top, (entry[0] for entry in best.values()))[-1]


def _best_splits(
    costs, placed: _Placed, tp, m, options, units_total, split_limit, memo: dict, beaten=None, every_option=True
) -> tuple[list[tuple[float, list[int], _Evaluator]], bool]:
    """(step, sizes, evaluator) of the best shares for each layer split tried, and whether a split that fits
    was dropped for being slower than ``beaten`` once its shares were searched (when every split is tried,
    those whose floor is above it are skipped unjudged, and a share search stops once its step must be above
    it: the caller takes such a split as found). Unless the caller tries ``every_option``, a split skipped
    by its floor is told apart from one stopped in its share search (the caller goes on to more frugal options
    after the first, as when none fits), so alike replicas' splits get a floor too."""
    pp = len(placed.grid)
    if math.comb(costs.n_layers - 1, pp - 1) <= split_limit:
        # The caller keeps one plan per shape, so only the best split counts: splits are judged lowest floor
        # first, each against the best so far, and the rest dropped once their floor is above it.
        held = []
        for order, stages in enumerate(splits(costs.n_layers, pp)):
            ev = _Evaluator(placed, costs, tp, m, stages, options, memo)
            if ev.holds(units_total):
                judge = len(placed.kinds) > 1 or (beaten is not None and not every_option)
                held.append((ev.floor(units_total) if judge else 0.0, order, ev))
        best: tuple[float, int, list[int], _Evaluator] | None = None
        pruned = False
        for floor, order, ev in sorted(held, key=lambda h: h[:2]):
            bounds = [b for b in (beaten, None if best is None else best[0]) if b is not None]
            bound = min(bounds) if bounds else None
            if bound is not None and floor > bound:
                break  # (not "pruned": skipped by floors alone, the caller goes on to the next options)
            shared = ev.shares(units_total, bound)
            if shared is None:
                pruned = pruned or ev.too_slow
            elif best is None or (shared[0], order) < best[:2]:
                best = (shared[0], order, shared[1], ev)
        return ([(best[0], best[2], best[3])] if best is not None else []), pruned
    speeds = [sum(u.spec.peak_tflops for u in row) for row in placed.grid]
    tried: dict[tuple, _Trial] = {}

    def attempt(stages: tuple) -> _Trial:
        if stages not in tried:
            ev = _Evaluator(placed, costs, tp, m, stages, options, memo)
            tried[stages] = _Trial(ev, ev.shares(units_total))
        return tried[stages]

    best = attempt(proportional_split(costs, speeds))
    for _ in range(MAX_MOVES):  # move a layer off the busiest (or fullest) stage while that helps
        moved = [_move_boundary(best.ev.base.stages, i, d) for i, d in _moves_off(best)]
        trials = [attempt(stages) for stages in moved if stages]
        if not trials or min(t.score for t in trials) >= best.score:
            break
        best = min(trials, key=lambda t: t.score)
    return ([(best.found[0], best.found[1], best.ev)] if best.found is not None else []), False


@dataclass(frozen=True)
class _Trial:
    ev: _Evaluator
    found: tuple[float, list[int]] | None

    @cached_property
    def score(self) -> tuple[int, float]:
        """Feasible by step time first; out of memory by how far over the fullest device is."""
        if self.found is not None:
            return (0, self.found[0])
        kinds = range(len(self.ev.placed.kinds))
        return (1, max(max(self.ev.memory_ratio(k, 1)) for k in kinds))


def _moves_off(trial: _Trial) -> list[tuple[int, int]]:
    """Boundary moves that take one layer off the stage that limits the step (or overflows memory)."""
    ev, result = trial.ev, trial.found
    pp = ev.base.pp
    if result is None:  # out of memory: the fullest stage of any replica at the smallest micro-batch
        ratios = [max(r) for r in zip(*(ev.memory_ratio(k, 1) for k in range(len(ev.placed.kinds))))]
        stage = max(range(pp), key=lambda s: ratios[s])
    else:
        kind_of = ev.placed.kind_of
        slow = max(range(ev.base.dp), key=lambda r: ev.time(kind_of[r], result[1][r]))
        times = ev.op_times(kind_of[slow], result[1][slow])
        stage = max(range(pp), key=lambda s: times.forward[s] + times.backward[s])
    moves = []
    if stage > 0:
        moves.append((stage, 1))  # its first layer goes to the stage before
    if stage < pp - 1:
        moves.append((stage + 1, -1))  # its last layer goes to the stage after
    return moves


def _move_boundary(stages, i: int, delta: int):
    bounds = [s[0] for s in stages] + [stages[-1][1]]
    bounds[i] += delta
    if bounds[i] <= bounds[i - 1] or bounds[i] >= bounds[i + 1]:
        return None
    return tuple(zip(bounds[:-1], bounds[1:]))


def _candidate(cluster: Cluster, costs: ModelCosts, *payload) -> Candidate:
    if isinstance(payload[0], Plan):  # replicas of different depth, planned whole
        plan, mixed, label = payload
        return Candidate(plan, mixed, estimate(mixed, costs), label)
    ev, sizes = payload
    layout, grid = ev.layout(sizes), ev.placed.grid
    m = layout.microbatches
    samples = tuple(b * m for b in sizes)
    placement = tuple(grid[s][r].devices[t] for s, r, t in grid_order(layout.pp, layout.dp, layout.tp))
    devices = cluster.devices()
    plan = Plan(
        dp=layout.dp,
        tp=layout.tp,
        pp=layout.pp,
        zero=layout.zero,
        offload=layout.offload,
        precision=costs.precision,
        dp_shares=samples if len(set(samples)) > 1 else None,
        pipeline=PipelineSpec(
            stages=layout.stages if layout.pp > 1 else None, microbatches=m, schedule=layout.schedule
        ),
        recompute=layout.recompute,
        rank_devices=tuple(f"{devices[d][0]}:{devices[d][1]}:{devices[d][2].name}" for d in placement),
        placement=placement if placement != tuple(range(len(devices))) else None,
    )
    return Candidate(plan, layout, estimate(layout, costs), ev.placed.label)


def _check_batch(cluster: Cluster, costs: ModelCosts, global_batch: int) -> None:
    if isinstance(global_batch, bool) or not isinstance(global_batch, int) or global_batch < 1:
        raise PlanError(f"global_batch_size must be a positive integer, got {global_batch!r}.")
    if next(degrees(cluster, costs, global_batch), None) is None:
        smallest = min((dp for _, _, dp in degrees(cluster, costs, cluster.world_size)), default=cluster.world_size)
        raise PlanError(
            f"global_batch_size={global_batch} is smaller than the number of data-parallel ranks of every layout "
            f"of this cluster (at least {smallest}: each rank needs one sample): raise global_batch_size to "
            f"{smallest} or more."
        )


# ---------------------------------------------------------------- exhaustive
def exhaustive_search(
    cluster: Cluster,
    costs: ModelCosts,
    global_batch: int,
    microbatches: tuple[int, ...] = (1, 2, 4, 8, 16, 32),
    judge: Callable[[Layout | MixedLayout], float] | None = None,
) -> tuple[float, Layout | MixedLayout | None]:
    """The best step time over every placement, split and share vector (small clusters only),
    and over every depth per pool, split and share vector of replicas of different depth.

    ``judge`` scores each layout that fits (default: the cost model's step time); the planner
    benchmark passes the simulator, for an optimum "exhaustive over the same space" that the
    search's own cost model did not pick.
    """
    best: float = INFEASIBLE
    best_layout: Layout | MixedLayout | None = None
    counts = tuple(m for m in microbatches if global_batch % m == 0)
    for step, _, mixed, _ in mixed_candidates(cluster, costs, global_batch, counts, exhaustive=True):
        if judge is not None and step < INFEASIBLE:
            step = judge(mixed)
        if step < best:
            best, best_layout = step, mixed
    judged: dict[Layout, float] = {}  # different placements often give the same layout
    for tp, pp, dp in degrees(cluster, costs, global_batch):
        units = units_of(cluster, tp, costs.precision)
        if units is None:
            continue
        for grid in grids(units, pp, dp):
            placed = _Placed.of(cluster, "every", grid)
            for m in microbatches:
                if global_batch % m or global_batch // m < dp:
                    continue
                for options in option_sets(dp, pp, tp):
                    for stages in splits(costs.n_layers, pp):
                        ev = _Evaluator(placed, costs, tp, m, stages, options)
                        for sizes in _compositions(global_batch // m, dp):
                            layout = ev.layout(list(sizes))
                            if layout not in judged:
                                ok = fits(layout, costs)
                                if not ok:
                                    judged[layout] = INFEASIBLE
                                else:
                                    judged[layout] = judge(layout) if judge else step_time(layout, costs)[0]
                            if judged[layout] < best:
                                best, best_layout = judged[layout], layout
    return best, best_layout


def _compositions(total: int, parts: int) -> Iterator[tuple[int, ...]]:
    """Every way to write ``total`` as ``parts`` positive integers, in order."""
    for cuts in itertools.combinations(range(1, total), parts - 1):
        bounds = (0, *cuts, total)
        yield tuple(b - a for a, b in zip(bounds[:-1], bounds[1:]))


__all__ = ["Candidate", "exhaustive_search", "search"]
