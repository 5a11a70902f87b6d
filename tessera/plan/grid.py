"""Rank arithmetic: the one place that turns a Plan and a number of ranks into who is where.

Everything that asks "which stage, replica, data or tp/sp index is rank r", "which rank sits at these
coordinates", "what mesh do the ranks form", "how many samples of a global batch does each rank take" or
"what layout does this job run" asks this module: the Plan's own methods (``Plan.resolve``,
``Plan.coords``, ...) are one-line doors to it, and the Booster, the launcher's checks, the planner and the
checkpoint all come here.

The rank order, written once (:func:`grid_coords`): row-major over (group, pp, dp, tp|sp), groups
outermost (a group's ranks are neighbours, like a region's), then pipeline stages (they talk point to
point, the cheapest traffic for slow links), and the ranks of one tp or sp group neighbours.

A :class:`Job` is one process's job resolved: the layout it runs (a fault-tolerant group is a job of its
own, laid out by its group's plan), which group it is, and the weights and batch split that follow.
:func:`resolve_job` makes one for a rank; :func:`launch_jobs` makes every job a launch will start, with
their batch splits checked, for the launcher's checks.

Example:
    >>> plan = Plan(tp=2, pp=2, pipeline={"microbatches": 2}).resolve(8)
    >>> coords(plan, 5)
    RankCoords(pp=1, dp=0, tp=1, sp=0, group=0)
    >>> rank_at(plan, coords(plan, 5))
    5
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from tessera.errors import NotSupportedYet, PlanError

if TYPE_CHECKING:  # types only: the Plan's fields module imports this one
    from tessera.plan.fields import Plan

UNRESOLVED = "Plan.dp is unknown: call Plan.resolve(world_size) first."


# --------------------------------------------------------------------------- the rank order
def grid_coords(rank: int, dp: int, inner: int) -> tuple[int, int, int]:
    """(pipeline stage, data-parallel index, index inside the tp or sp group) of ``rank`` on a
    pp × dp × inner grid. The one place the rank order is written: row-major over (pp, dp, inner),
    pp outermost (stages talk point-to-point, the cheapest traffic for slow links), and the ranks
    of one tp or sp group neighbours. :func:`coords` and the planner's placements use it."""
    return rank // (dp * inner), (rank // inner) % dp, rank % inner


def grid_order(pp: int, dp: int, inner: int) -> list[tuple[int, int, int]]:
    """:func:`grid_coords` of ranks 0, 1, ... of a pp × dp × inner grid, in rank order."""
    return [grid_coords(rank, dp, inner) for rank in range(pp * dp * inner)]


@dataclass(frozen=True)
class RankCoords:
    """A rank's place in a Plan: pipeline stage (its stage within its replica under Plan.replicas),
    data-parallel index (its replica), tensor-parallel and Ulysses sequence-parallel index."""

    pp: int = 0
    dp: int = 0
    tp: int = 0
    sp: int = 0
    group: int = 0  # under Plan.groups: which group; the other coordinates are inside it


# --------------------------------------------------------------------------- resolving
def resolve(plan: Plan, world_size: int) -> Plan:
    """``plan`` with ``dp`` filled in for ``world_size`` ranks, the product checked, and the resolved sizes
    checked to compose (:meth:`Plan.check_composable`)."""
    if plan.replicas is not None:
        return _resolve_replicas(plan, world_size)
    mp = plan.model_parallel_size
    dp = plan.dp
    ranks, job = world_size, f"the job has {world_size} ranks"
    if plan.groups is not None:
        if plan.groups.uneven:  # set only with fault_tolerant: each group is its own job, laid out alone
            raise PlanError(
                f"Plan.groups.sizes={list(plan.groups.sizes or ())} differ, so each group is its own job: resolve "
                "the Plan without groups on one group's ranks (the Booster does)."
            )
        count = plan.groups.count
        ranks = group_worlds(plan.groups, world_size)[0]
        job = f"each of the {count} groups has {ranks} ranks"
    if dp is None:
        if ranks % mp:
            raise PlanError(f"{job}, which tp×pp×sp={mp} does not divide: change Plan.tp/pp/sp or the number of ranks.")
        dp = ranks // mp
    if dp * mp != ranks:
        raise PlanError(
            f"Plan.dp×tp×pp×sp = {dp}×{plan.tp}×{plan.pp}×{plan.ulysses_size} = {dp * mp} but {job}: "
            "make the product equal (or leave Plan.dp unset)."
        )
    if plan.dp_shares is not None and len(plan.dp_shares) != dp:
        raise PlanError(
            f"Plan.dp_shares has {len(plan.dp_shares)} entries but the data-parallel size is {dp} "
            f"({ranks} ranks / tp×pp×sp={mp}): give one share per data-parallel rank."
        )
    if dp % plan.ep:
        raise PlanError(
            f"Plan.ep={plan.ep} must divide the data-parallel size dp={dp}: expert parallelism splits the "
            "experts over data-parallel ranks; choose an ep that divides dp."
        )
    _check_rank_lists(plan, world_size)
    resolved = dataclasses.replace(plan, dp=dp)
    resolved.check_composable()
    return resolved


def _resolve_replicas(plan: Plan, world_size: int) -> Plan:
    assert plan.replicas is not None
    sizes = [r.size for r in plan.replicas]
    if sum(sizes) != world_size:
        shown = "+".join(f"{r.depth}x tp{r.tp}" if r.tp > 1 else str(r.depth) for r in plan.replicas)
        raise PlanError(
            f"Plan.replicas need {sum(sizes)} ranks (depths {shown}) but the job has "
            f"{world_size}: launch {sum(sizes)} ranks or change the replicas."
        )
    _check_rank_lists(plan, world_size)
    if plan.groups is not None:
        raise NotSupportedYet(
            "Plan.groups with Plan.replicas is not supported yet: lay each group out with data, ZeRO, tensor or "
            "pipeline parallelism."
        )
    return dataclasses.replace(plan, dp=len(plan.replicas))


def _check_rank_lists(plan: Plan, world_size: int) -> None:
    if plan.rank_devices is not None and len(plan.rank_devices) != world_size:
        raise PlanError(f"Plan.rank_devices names {len(plan.rank_devices)} devices but the job has {world_size} ranks.")
    if plan.placement is not None and (len(plan.placement) != world_size or len(set(plan.placement)) != world_size):
        raise PlanError(
            f"Plan.placement must name {world_size} different cluster devices, one per rank (the device each "
            f"rank runs on; devices left out of the job are simply not named), got {list(plan.placement)}."
        )


def group_worlds(groups: Any, ranks: int) -> list[int]:
    """Ranks of each of ``groups`` (a Plan's :class:`~tessera.plan.groups.Groups`) when ``ranks`` are launched
    for all of them (refused when they do not fit)."""
    if groups.sizes is not None:
        if sum(groups.sizes) != ranks:
            raise PlanError(
                f"Plan.groups.sizes={list(groups.sizes)} make {sum(groups.sizes)} ranks but {ranks} were launched: "
                f"launch {sum(groups.sizes)} or change the sizes."
            )
        return list(groups.sizes)
    if ranks % groups.count:
        raise PlanError(
            f"Plan.groups.count={groups.count} does not divide the {ranks} ranks: groups are equal, so launch a "
            f"multiple of {groups.count} ranks or change the count."
        )
    return [ranks // groups.count] * groups.count


def group_plan(plan: Plan, group: int) -> Plan:
    """The Plan group ``group`` of fault-tolerant ``groups`` runs as its own job: ``plan``'s fields, without
    the groups, with what ``groups.layouts`` sets for that group (a bad value is named by its group)."""
    assert plan.groups is not None
    fields = plan.groups.layout_fields(group)
    if plan.rank_devices is not None and plan.groups.sizes is not None:  # the group's own block of the ranks
        first = sum(plan.groups.sizes[:group])
        fields["rank_devices"] = plan.rank_devices[first : first + plan.groups.sizes[group]]
    try:
        if "pipeline" in fields:
            fields["pipeline"] = dataclasses.replace(plan.pipeline, **fields["pipeline"])
        return dataclasses.replace(plan, groups=None, **fields)
    except PlanError as exc:
        raise PlanError(f"Plan.groups.layouts[{group}]: {exc}") from None


def check_group_job(groups: Any, group: int, plan: Plan, world: int) -> None:
    """A fault-tolerant group's job (``plan``, resolved, on ``world`` ranks) against ``groups.sizes``, and
    a layout that groups which differ can sync in canonical slots: replicas or shards of every parameter on
    every rank."""
    if groups.sizes is not None and groups.sizes[group] != world:
        raise PlanError(
            f"Plan.groups.sizes[{group}]={groups.sizes[group]} but group {group}'s job has {world} ranks: launch "
            f"{groups.sizes[group]} (tessera train gives each group its size) or change the sizes."
        )
    if groups.differ and (plan.ulysses_size > 1 or plan.replicas is not None):
        raise NotSupportedYet(
            "Plan.groups: groups that differ in size or layout meet in canonical slots of the whole model; lay "
            "them out with data parallelism, ZeRO, tensor or pipeline parallelism (sequence parallelism and "
            "replicas of different depth inside them are not supported yet)."
        )


# --------------------------------------------------------------------------- where ranks sit
def mesh_shape(plan: Plan) -> tuple[tuple[int, ...], tuple[str, ...]]:
    """Sizes and names of the device mesh of a resolved grid Plan: ranks are laid out row-major
    over (pp, dp, tp) or (pp, dp, sp), pp outermost (stages talk point-to-point, the cheapest
    traffic for slow links), then dp; the ranks of one tp or sp group are neighbours."""
    if plan.dp is None:
        raise PlanError(UNRESOLVED)
    if plan.replicas is not None:
        raise PlanError(
            "Plan.replicas has no device mesh: its replicas differ in depth, so ranks form no dp × pp grid."
        )
    shape, names = ([plan.dp // plan.ep, plan.ep], ["dp_rep", "ep"]) if plan.ep > 1 else ([plan.dp], ["dp"])
    if plan.tp > 1:
        shape, names = [*shape, plan.tp], [*names, "tp"]
    elif plan.ulysses_size > 1:
        shape, names = [plan.dp, plan.sp], ["dp", "sp"]
    if plan.pp > 1:
        shape, names = [plan.pp, *shape], ["pp", *names]
    if plan.groups is not None:  # outermost: a group's ranks are neighbours, like a region's
        shape, names = [plan.groups.count, *shape], ["group", *names]
    return tuple(shape), tuple(names)


def group_size(plan: Plan) -> int:
    """Ranks per group of a resolved grid Plan (every rank when there are no Plan.groups)."""
    if plan.dp is None:
        raise PlanError(UNRESOLVED)
    return plan.dp * plan.model_parallel_size


def coords(plan: Plan, rank: int) -> RankCoords:
    """Where ``rank`` sits in a resolved Plan: its pipeline stage, data-parallel index (its replica under
    Plan.replicas) and tp / Ulysses sp index (the inverse of :func:`rank_at`)."""
    if plan.replicas is not None:
        first = 0
        for index, replica in enumerate(plan.replicas):
            if rank < first + replica.size:
                stage, tp = divmod(rank - first, replica.tp)
                return RankCoords(pp=stage, dp=index, tp=tp)
            first += replica.size
        raise PlanError(f"rank {rank} is past the {first} ranks of Plan.replicas.")
    if plan.dp is None:
        raise PlanError(UNRESOLVED)
    group, rank = divmod(rank, group_size(plan))
    stage, dp, inner = grid_coords(rank, plan.dp, plan.tp * plan.ulysses_size)
    return RankCoords(
        pp=stage, dp=dp, tp=inner if plan.tp > 1 else 0, sp=inner if plan.ulysses_size > 1 else 0, group=group
    )


def rank_at(plan: Plan, at: RankCoords) -> int:
    """The global rank at ``at`` (the inverse of :func:`coords`)."""
    if plan.replicas is not None:
        return sum(r.size for r in plan.replicas[: at.dp]) + at.pp * plan.replicas[at.dp].tp + at.tp
    if plan.dp is None:
        raise PlanError(UNRESOLVED)
    inner = (at.pp * plan.dp + at.dp) * plan.tp * plan.ulysses_size + at.tp + at.sp
    return at.group * group_size(plan) + inner


def replica_ranks(plan: Plan, index: int) -> list[int]:
    """The global ranks of replica ``index`` of a ``Plan.replicas`` plan, in stage order (a stage's tp ranks
    next to each other)."""
    assert plan.replicas is not None
    replica = plan.replicas[index]
    return [rank_at(plan, RankCoords(pp=s, dp=index, tp=t)) for s in range(replica.depth) for t in range(replica.tp)]


def device_of(plan: Plan, rank: int) -> int:
    """The cluster device (file order) that ``rank`` runs on."""
    return plan.placement[rank] if plan.placement is not None else rank


# --------------------------------------------------------------------------- samples
def split_batch(global_batch_size: int, shares: Sequence[int]) -> list[int]:
    """Samples per data-parallel rank; refuses a batch that does not split exactly."""
    if isinstance(global_batch_size, bool) or not isinstance(global_batch_size, int) or global_batch_size <= 0:
        raise PlanError(f"global_batch_size must be a positive integer, got {global_batch_size!r}.")
    total = sum(shares)
    if global_batch_size < len(shares):
        raise PlanError(
            f"global_batch_size={global_batch_size} is smaller than the {len(shares)} data-parallel ranks: "
            "every rank needs at least one sample."
        )
    if global_batch_size % total:
        lower = global_batch_size - global_batch_size % total
        raise PlanError(
            f"global_batch_size={global_batch_size} cannot be split in the proportions of the data-parallel "
            f"shares (Plan.dp_shares or Plan.replicas[i].share) {tuple(shares)} (sum {total}): use a multiple "
            f"of {total}, e.g. {lower or total} or {lower + total}."
        )
    return [global_batch_size * s // total for s in shares]


def shares(plan: Plan, dp: int | None = None) -> tuple[int, ...]:
    """Relative samples per data-parallel rank (all ones when the plan is even)."""
    if plan.replicas is not None:
        return tuple(r.share for r in plan.replicas)
    dp = dp or plan.dp
    if dp is None:
        raise PlanError(UNRESOLVED)
    return plan.dp_shares if plan.dp_shares is not None else (1,) * dp


def samples_per_rank(plan: Plan, global_batch_size: int) -> list[int]:
    """Samples each data-parallel rank (each replica) takes of every global batch, by share."""
    return split_batch(global_batch_size, shares(plan))


def batch_split(plan: Plan, global_batch_size: int) -> list[int]:
    """Samples of every global batch per data-parallel rank of the whole job: group after group under
    Plan.groups (split by ``groups.shares``, then by ``dp_shares`` inside each group)."""
    if plan.groups is None:
        return samples_per_rank(plan, global_batch_size)
    per_group = split_batch(global_batch_size, plan.groups.group_shares())
    return [n for samples in per_group for n in split_batch(samples, shares(plan))]


def data_rank(plan: Plan, rank: int) -> int:
    """Which entry of :func:`batch_split` ``rank`` reads."""
    at = coords(plan, rank)
    return at.group * len(shares(plan)) + at.dp


# --------------------------------------------------------------------------- one job
@dataclass(frozen=True)
class Job:
    """One job's layout, resolved: ``plan`` is what its ranks lay out (the whole Plan, or a fault-tolerant
    group's own plan, which has no groups of its own); ``groups``: the Plan's groups; ``group``: which group
    this job is when each group is a job of its own (None: the job holds every group, or there are none)."""

    plan: Plan
    groups: Any = None  # the Plan's Groups
    group: int | None = None

    def group_of(self, rank: int) -> int:
        """The group ``rank`` trains in (0 without groups)."""
        return self.group if self.group is not None else coords(self.plan, rank).group

    def group_weights(self) -> list[float]:
        """Each group's share of the global batch (they sum to 1; [1.0] without groups)."""
        if self.groups is None:
            return [1.0]
        group_shares = self.groups.group_shares()
        return [s / sum(group_shares) for s in group_shares]

    def share_weight(self, rank: int) -> float:
        """``rank``'s share of its group's batch, relative to an even split: each rank's loss is a mean over its
        own samples, so weighted by this the averaged gradient is the mean over the group's whole batch."""
        rank_shares = shares(self.plan)
        return rank_shares[coords(self.plan, rank).dp] * len(rank_shares) / sum(rank_shares)

    def loss_weight(self, rank: int) -> float:
        """What ``rank`` weighs its loss by: its share weight, times its group's share of the global batch
        when gradients are averaged across groups every step (then over every group's ranks)."""
        weight = self.share_weight(rank)
        if self.groups is not None and self.groups.sync == "every_step":
            weight *= self.group_weights()[self.group_of(rank)] * self.groups.count
        return weight

    def batch_split(self, global_batch_size: int, rank: int) -> tuple[list[int], int]:
        """Samples of every global batch per data rank (the shares, group after group) and which entry
        ``rank`` reads. A fault-tolerant group's job knows its own ranks only: the other groups count as one
        entry each, their share of the batch, which puts this group's samples where they would be."""
        if self.group is None:
            return batch_split(self.plan, global_batch_size), data_rank(self.plan, rank)
        per_group = split_batch(global_batch_size, self.groups.group_shares())
        g = self.group
        mine = split_batch(per_group[g], shares(self.plan))
        return [*per_group[:g], *mine, *per_group[g + 1 :]], g + data_rank(self.plan, rank)


def resolve_job(plan: Plan, world: int, group: int | None = None) -> Job:
    """The job of ``world`` ranks that ``plan`` asks for: resolved once per process (the Booster's, and each
    job the launcher checks). Under fault-tolerant groups each group is its own job: ``group`` says which,
    and its own plan (:func:`group_plan`) is resolved on ``world``, its ranks."""
    groups = plan.groups
    if groups is None or not groups.fault_tolerant:
        return Job(resolve(plan, world), groups)
    if group is None or not 0 <= group < groups.count:
        raise PlanError(
            f"group {group} is not one of the {groups.count} groups of Plan.groups (0 to {groups.count - 1})."
        )
    try:
        resolved = resolve(group_plan(plan, group), world)
    except PlanError as exc:
        raise type(exc)(f"group {group} of Plan.groups, on its {world} ranks: {exc}") from None
    check_group_job(groups, group, resolved, world)
    return Job(resolved, groups, group)


def launch_jobs(plan: Plan, world: int, global_batch_size: int, group: int | None = None) -> list[Job]:
    """Every job a launch of ``world`` ranks starts, each checked to split ``global_batch_size``: one, or
    under fault-tolerant groups one per group (``group``: that group's alone, ``world`` its ranks)."""
    groups = plan.groups
    if groups is None or not groups.fault_tolerant:
        places = [(None, world)]
    elif group is not None:
        if not 0 <= group < groups.count:
            raise PlanError(f"--group {group} is not one of the {groups.count} groups (0 to {groups.count - 1}).")
        places = [(group, world)]
    else:
        places = list(enumerate(group_worlds(groups, world)))
    jobs = [resolve_job(plan, ranks, g) for g, ranks in places]
    for job in jobs:
        job.batch_split(global_batch_size, 0)
    return jobs
