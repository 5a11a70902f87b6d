"""The Plan: a plain, serialisable description of how one training job is laid out.

Presets and (later) the planner produce Plans; the Booster only reads them.
A Plan is a frozen dataclass tree that validates itself on construction and
round-trips through JSON and YAML.

Example:
    >>> plan = Plan(zero=3, precision="bf16", dp_shares=(3, 1))
    >>> Plan.from_json(plan.to_json()) == plan
    True
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from tessera.errors import NotSupportedYet, PlanError, nearest
from tessera.groups import Groups
from tessera.inputs import InputError, as_tuple, load_yaml, read_text, shown

PRECISIONS = ("fp32", "bf16", "fp16")
SCHEDULES = (
    "gpipe",
    "1f1b",
    "interleaved_1f1b",
    "looped_bfs",
    "interleaved_zero_bubble",
    "zbv_zero_bubble",
    "dualpipev",
)
# Schedules with one stage per rank, with exactly two per rank in a V shape, and the rest
# (interleaved: any whole number of stages per rank, two by default).
SINGLE_STAGE_SCHEDULES = ("gpipe", "1f1b")
V_SCHEDULES = ("zbv_zero_bubble", "dualpipev")
SPLIT_BACKWARD_SCHEDULES = ("interleaved_zero_bubble", "zbv_zero_bubble", "dualpipev")  # input and weight grads apart
ROUND_SCHEDULES = ("interleaved_1f1b", "interleaved_zero_bubble")  # micro-batches run in rounds of pp
RECOMPUTE = ("none", "selective", "full")
SP_MODES = ("split_gather", "all_to_all")
DEVICES = ("auto", "cpu", "cuda")


# Upper bounds: what a typo (an extra zero) may ask for. tp/sp and pp keep the limits the
# config had before it took the Plan's own schema (a head count, a layer count).
MAX_SIZE = 1 << 20  # data-parallel ranks
MAX_GROUP = 1 << 16  # tensor- or sequence-parallel ranks
MAX_STAGES = 1024  # pipeline ranks (every stage needs a layer)
MAX_COUNT = 1 << 24  # micro-batches, shares


def _check_int(name: str, value: Any, minimum: int = 1, maximum: int = MAX_SIZE) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise PlanError(f"Plan.{name} must be an integer, got {shown(value)} ({type(value).__name__}).")
    if value < minimum:
        raise PlanError(f"Plan.{name} must be >= {minimum}, got {value}.")
    if value > maximum:
        raise PlanError(f"Plan.{name} must be at most {maximum}, got {value}.")


def _check_choice(name: str, value: Any, choices: tuple[str, ...]) -> None:
    if value not in choices:
        hint = nearest(str(value), choices)
        raise PlanError(f"Plan.{name}={value!r} is not one of {', '.join(choices)}{hint}.")


def _check_ranges(name: str, stages: Any) -> None:
    """Stage layer ranges: ``(first, end)`` pairs from layer 0, each starting where the last ended."""
    if not isinstance(stages, tuple) or not stages:
        raise PlanError(f"Plan.{name} must be a list of layer ranges [first, end], got {stages!r}.")
    for i, stage in enumerate(stages):
        if (
            not isinstance(stage, tuple)
            or len(stage) != 2
            or not all(isinstance(x, int) and not isinstance(x, bool) for x in stage)
            or not 0 <= stage[0] < stage[1]
        ):
            raise PlanError(f"Plan.{name}[{i}]={stage!r} must be a layer range (first, end) with 0 <= first < end.")
    if stages[0][0] != 0:
        raise PlanError(
            f"Plan.{name}[0]={stages[0]!r} must start at layer 0: layers 0-{stages[0][0] - 1} would belong to no stage."
        )
    for i in range(1, len(stages)):
        prev, this = stages[i - 1], stages[i]
        if this[0] < prev[1]:
            raise PlanError(
                f"Plan.{name}[{i - 1}]={prev!r} and [{i}]={this!r} overlap: layers "
                f"{this[0]}-{prev[1] - 1} would run twice. Stage i must start where stage i-1 ends."
            )
        if this[0] > prev[1]:
            raise PlanError(
                f"Plan.{name}[{i - 1}]={prev!r} and [{i}]={this!r} leave a gap: layers "
                f"{prev[1]}-{this[0] - 1} belong to no stage."
            )


@dataclass(frozen=True)
class PipelineSpec:
    """How the model is cut into pipeline stages and scheduled.

    ``stages`` holds one ``(first_layer, end_layer)`` half-open range per stage;
    stages may be uneven. ``None`` means "split the layers evenly".
    """

    stages: tuple[tuple[int, int], ...] | None = None
    microbatches: int = 1
    schedule: str = "1f1b"

    def __post_init__(self) -> None:
        object.__setattr__(self, "stages", as_tuple(self.stages))
        _check_int("pipeline.microbatches", self.microbatches, maximum=MAX_COUNT)
        _check_choice("pipeline.schedule", self.schedule, SCHEDULES)
        if self.stages is not None:
            _check_ranges("pipeline.stages", self.stages)

    def stages_per_rank(self, pp: int) -> int:
        """Pipeline stages each of ``pp`` ranks runs (more than one for interleaved and V schedules)."""
        if self.stages is not None:
            return len(self.stages) // pp
        return 1 if self.schedule in SINGLE_STAGE_SCHEDULES else 2

    def stage_ranges(self, n_layers: int, pp: int) -> tuple[tuple[int, int], ...]:
        """Each stage's ``(first, end)`` layer range: ``stages`` as given, or an even split."""
        self.check_layers(n_layers)
        if self.stages is not None:
            return self.stages
        n = pp * self.stages_per_rank(pp)
        if n > n_layers:
            raise PlanError(
                f"Plan.pipeline: {n} stages ({pp} ranks x {n // pp} stages for schedule {self.schedule!r}) but the "
                f"model has only {n_layers} layers: every stage needs at least one layer; lower Plan.pp or pick a "
                "schedule with one stage per rank (gpipe, 1f1b)."
            )
        bounds = [round(i * n_layers / n) for i in range(n + 1)]
        return tuple(zip(bounds[:-1], bounds[1:]))

    def check_schedule(self, pp: int) -> None:
        """Refuse a stage count or micro-batch count that the schedule cannot run on ``pp`` ranks."""
        if pp == 1:
            if self.stages is not None and len(self.stages) != 1:
                raise PlanError(
                    f"Plan.pipeline.stages lists {len(self.stages)} stages but Plan.pp=1: set Plan.pp or drop stages."
                )
            return
        per_rank, mb, name = self.stages_per_rank(pp), self.microbatches, self.schedule
        if name in SINGLE_STAGE_SCHEDULES and per_rank != 1:
            raise PlanError(
                f"Plan.pipeline.schedule={name!r} runs one stage per rank but Plan.pipeline.stages gives {per_rank} "
                f"per rank: give {pp} stages, or use an interleaved schedule (interleaved_1f1b, ...)."
            )
        if name in V_SCHEDULES and per_rank != 2:
            raise PlanError(
                f"Plan.pipeline.schedule={name!r} runs exactly two stages per rank (a V shape) but "
                f"Plan.pipeline.stages gives {per_rank} per rank: give {2 * pp} stages."
            )
        n_stages = pp * per_rank
        if name in ("1f1b", "dualpipev") and mb < n_stages:
            raise PlanError(
                f"Plan.pipeline.microbatches={mb}: schedule {name!r} needs at least as many micro-batches as "
                f"stages ({n_stages}); raise microbatches or use gpipe."
            )
        rounds = max(1, mb // pp)
        if name in ROUND_SCHEDULES and mb % rounds:
            raise PlanError(
                f"Plan.pipeline.microbatches={mb}: schedule {name!r} on {pp} ranks runs micro-batches in "
                f"{rounds} equal rounds, and {mb} is not divisible by {rounds}: "
                f"use {mb - mb % rounds} or {mb - mb % rounds + rounds}."
            )

    def check_layers(self, n_layers: int) -> None:
        """Check the stage ranges against a model with ``n_layers`` transformer blocks."""
        if self.stages is None:
            return
        if len(self.stages) > n_layers:
            raise PlanError(
                f"Plan.pipeline.stages has {len(self.stages)} stages but the model has only {n_layers} layers: "
                "every stage needs at least one layer."
            )
        if self.stages[-1][1] != n_layers:
            raise PlanError(
                f"Plan.pipeline.stages end at layer {self.stages[-1][1]} but the model has {n_layers} layers: "
                f"the last stage must end at {n_layers}."
            )


@dataclass(frozen=True)
class Replica:
    """One data-parallel replica of a plan whose replicas differ in depth (``Plan.replicas``).

    ``stages``: the ``(first_layer, end_layer)`` range of each of its pipeline stages, one rank
    each; a single stage ``((0, n_layers),)`` is a whole model on one device. ``share``: its
    relative number of samples of every global batch.

    Example (the Zorse shape: one fast device holds all 8 layers, two slow ones split them):
        >>> plan = Plan(replicas=(Replica([(0, 8)], share=2), Replica([(0, 4), (4, 8)])), pipeline={"microbatches": 2})
        >>> plan.resolve(world_size=3).shares()
        (2, 1)
    """

    stages: tuple[tuple[int, int], ...]
    share: int = 1

    def __post_init__(self) -> None:
        object.__setattr__(self, "stages", as_tuple(self.stages))

    @property
    def depth(self) -> int:
        """Pipeline stages, and so ranks, of this replica."""
        return len(self.stages)


def grid_coords(rank: int, dp: int, inner: int) -> tuple[int, int, int]:
    """(pipeline stage, data-parallel index, index inside the tp or sp group) of ``rank`` on a
    pp × dp × inner grid. The one place the rank order is written: row-major over (pp, dp, inner),
    pp outermost (stages talk point-to-point, the cheapest traffic for slow links), and the ranks
    of one tp or sp group neighbours. :meth:`Plan.coords` and the planner's placements use it."""
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


@dataclass(frozen=True)
class Plan:
    """How one training job is laid out over the ranks of a process group.

    Fields:
        dp: data-parallel size; ``None`` fills every rank left by tp × pp × sp.
        tp, pp, sp: tensor-, pipeline- and sequence-parallel sizes.
        ep: expert-parallel size: the experts of each MoE layer split over ``ep`` neighbouring
            data-parallel ranks (tokens go to their experts' ranks and back by all-to-all); it divides
            dp, adds no ranks, and expert weights are averaged over the dp / ep ranks that hold the same.
        expert_shares: with ep, how many experts of each MoE layer each ep rank holds (in ep order;
            they sum to the layer's experts), e.g. ``(3, 3, 1, 1)`` for 8 experts on ranks of speed
            1, 1, ½, ½; ``None``: experts / ep each.
        sp_mode: ``"split_gather"`` (Megatron: activations split along the sequence over the tp
            ranks outside attention and MLP; needs sp == tp and adds no ranks) or
            ``"all_to_all"`` (Ulysses: sp more ranks, each holding a slice of every sequence).
        zero: ZeRO stage 0–3 over the data-parallel axis (0 is plain DDP).
        offload: keep sharded state on the CPU between uses.
        precision: ``"fp32"``, ``"bf16"`` or ``"fp16"`` (dynamic loss scaling).
        dp_shares: relative number of samples each data-parallel rank takes
            from every global batch, e.g. ``(3, 1)``; ``None`` means equal.
        pipeline: stage layer ranges, micro-batch count and schedule.
        recompute: activation recompute, ``"none"``, ``"selective"`` or ``"full"``.
        loss_parallel: with tp, keep the logits split over the vocabulary (a DTensor) and compute
            the cross-entropy on the shards under ``booster.loss_parallel()``: full logits are
            never gathered.
        device: ``"auto"`` (CUDA when present, else CPU), ``"cpu"`` or ``"cuda"``.
        rank_devices: optional device label per global rank (heterogeneous clusters).
        placement: the cluster device (its index in the cluster file's order) each rank runs on;
            the planner uses it to put each device where it belongs on the mesh (ranks are laid out
            row-major over pp, dp, tp|sp). ``None``: rank i runs on device i. A plan may leave devices
            out (the planner does when a slow device costs more than it gives): they are not named.
        replicas: data-parallel replicas whose pipelines differ in depth (:class:`Replica`), instead
            of dp × pp: replica i takes the next ``depth`` ranks, one stage each, and every layer's
            gradient is averaged over the ranks that hold it. Needs tp = sp = pp = 1 and ZeRO-0;
            micro-batches and schedule come from ``pipeline``.
        groups: the ranks split into equal groups (regions) that train apart and meet at an outer
            synchronisation (:class:`~tessera.groups.Groups`: DiLoCo, or none). Every other field
            lays out each group; ``dp`` and ``dp_shares`` are a group's.
    """

    dp: int | None = None
    tp: int = 1
    pp: int = 1
    sp: int = 1
    ep: int = 1
    sp_mode: str = "all_to_all"
    zero: int = 0
    offload: bool = False
    precision: str = "fp32"
    dp_shares: tuple[int, ...] | None = None
    expert_shares: tuple[int, ...] | None = None
    pipeline: PipelineSpec = field(default_factory=PipelineSpec)
    recompute: str = "none"
    loss_parallel: bool = False
    device: str = "auto"
    rank_devices: tuple[str, ...] | None = None
    placement: tuple[int, ...] | None = None
    replicas: tuple[Replica, ...] | None = None
    groups: Groups | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "dp_shares", as_tuple(self.dp_shares))
        object.__setattr__(self, "expert_shares", as_tuple(self.expert_shares))
        object.__setattr__(self, "rank_devices", as_tuple(self.rank_devices))
        object.__setattr__(self, "placement", as_tuple(self.placement))
        if isinstance(self.pipeline, dict):
            object.__setattr__(self, "pipeline", _from_dict(PipelineSpec, self.pipeline, "pipeline"))
        if self.replicas is not None:
            object.__setattr__(self, "replicas", _replicas_from(self.replicas))
        if isinstance(self.groups, dict):
            object.__setattr__(self, "groups", _from_dict(Groups, self.groups, "groups"))
        if self.groups is not None and not isinstance(self.groups, Groups):
            raise PlanError(f"Plan.groups must be a mapping (count, sync, inner_steps, ...), got {shown(self.groups)}.")
        if self.groups is not None:
            for g in range(self.groups.count if self.groups.layouts is not None else 0):
                self.group_plan(g)  # each group's own layout is a Plan: checked now, named by its group
        if self.dp is not None:
            _check_int("dp", self.dp)
        _check_int("tp", self.tp, maximum=MAX_GROUP)
        _check_int("pp", self.pp, maximum=MAX_STAGES)
        _check_int("sp", self.sp, maximum=MAX_GROUP)
        _check_int("ep", self.ep, maximum=MAX_GROUP)
        if isinstance(self.zero, bool) or not isinstance(self.zero, int) or not 0 <= self.zero <= 3:
            raise PlanError(f"Plan.zero must be a ZeRO stage 0, 1, 2 or 3, got {self.zero!r}.")
        if not isinstance(self.offload, bool):
            raise PlanError(f"Plan.offload must be true or false, got {self.offload!r}.")
        if not isinstance(self.loss_parallel, bool):
            raise PlanError(f"Plan.loss_parallel must be true or false, got {self.loss_parallel!r}.")
        if self.loss_parallel and self.tp == 1:
            raise PlanError(
                "Plan.loss_parallel=True splits the logits over tensor-parallel ranks: it needs Plan.tp > 1."
            )
        _check_choice("precision", self.precision, PRECISIONS)
        _check_choice("sp_mode", self.sp_mode, SP_MODES)
        _check_choice("recompute", self.recompute, RECOMPUTE)
        _check_choice("device", self.device, DEVICES)
        if not isinstance(self.pipeline, PipelineSpec):
            raise PlanError(f"Plan.pipeline must be a PipelineSpec, got {type(self.pipeline).__name__}.")
        if self.dp_shares is not None:
            if not isinstance(self.dp_shares, tuple) or not self.dp_shares:
                raise PlanError(f"Plan.dp_shares must be a list of positive integers, got {self.dp_shares!r}.")
            for i, share in enumerate(self.dp_shares):
                if isinstance(share, bool) or not isinstance(share, int) or not 0 < share <= MAX_COUNT:
                    raise PlanError(
                        f"Plan.dp_shares[{i}]={share!r}: every share must be a positive integer "
                        f"(a slow device gets a smaller share, never zero or less; at most {MAX_COUNT})."
                    )
            if self.dp is not None and len(self.dp_shares) != self.dp:
                raise PlanError(
                    f"Plan.dp_shares has {len(self.dp_shares)} entries but Plan.dp={self.dp}: "
                    "give one share per data-parallel rank."
                )
        if self.expert_shares is not None:
            self._check_expert_shares()
        if self.placement is not None and (
            not isinstance(self.placement, tuple)
            or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in self.placement)
        ):
            raise PlanError(
                f"Plan.placement must be a list of cluster device indices (0, 1, ...), one per rank, "
                f"got {shown(self.placement)}."
            )
        if self.rank_devices is not None and (
            not isinstance(self.rank_devices, tuple) or not all(isinstance(d, str) for d in self.rank_devices)
        ):
            raise PlanError(
                f"Plan.rank_devices must be a list of device names, one per rank, got {shown(self.rank_devices)}."
            )
        if self.replicas is not None:  # before the grid checks below, whose advice would not apply
            self._check_replicas()
        stages = self.pipeline.stages
        if stages is not None and len(stages) % self.pp:
            raise PlanError(
                f"Plan.pipeline.stages lists {len(stages)} stages for Plan.pp={self.pp} ranks: give pp stages, "
                "or a multiple of pp for interleaved schedules (several stages per rank)."
            )
        self.pipeline.check_schedule(self.pp)
        if self.sp > 1 and self.sp_mode == "split_gather" and self.sp != self.tp:
            raise PlanError(
                f"Plan.sp={self.sp} with sp_mode='split_gather' must equal Plan.tp={self.tp}: Megatron sequence "
                "parallelism splits activations over the tensor-parallel ranks. Set sp=tp, or use "
                "sp_mode='all_to_all' (Ulysses) for sequence parallelism without tp."
            )
        if self.offload and self.zero == 0:
            raise PlanError(
                "Plan.offload=True needs a ZeRO stage (Plan.zero=1, 2 or 3): DDP keeps everything on the device."
            )

    def _check_expert_shares(self) -> None:
        """One positive count per ep rank (their sum is checked against the model's experts when it is laid out)."""
        shares = self.expert_shares
        if not isinstance(shares, tuple) or not shares:
            raise PlanError(f"Plan.expert_shares must be a list of positive integers, got {shares!r}.")
        for i, share in enumerate(shares):
            if isinstance(share, bool) or not isinstance(share, int) or not 0 < share <= MAX_COUNT:
                raise PlanError(
                    f"Plan.expert_shares[{i}]={share!r}: every ep rank holds a positive number of experts "
                    f"(at most {MAX_COUNT})."
                )
        if len(shares) != self.ep:
            raise PlanError(
                f"Plan.expert_shares has {len(shares)} entries but Plan.ep={self.ep}: give the number of experts "
                "each expert-parallel rank holds, one entry per ep rank."
            )

    def _check_replicas(self) -> None:
        """Replicas of different depth replace dp × pp: the fields that describe a grid must stay unset."""
        assert self.replicas is not None
        for name, value, unset in (
            ("tp", self.tp, 1),
            ("pp", self.pp, 1),
            ("sp", self.sp, 1),
            ("ep", self.ep, 1),
            ("dp_shares", self.dp_shares, None),
            ("expert_shares", self.expert_shares, None),
            ("pipeline.stages", self.pipeline.stages, None),
        ):
            if value != unset:
                raise PlanError(
                    f"Plan.replicas lays out every rank itself, so Plan.{name} must stay {unset} (got {value!r}): "
                    "give each replica's stages and share in Plan.replicas instead."
                )
        if self.zero:
            raise NotSupportedYet(
                f"Plan.zero={self.zero} with Plan.replicas is not supported yet: each layer's gradient is averaged "
                "over the ranks that hold it, and sharding over those uneven groups is not written; use zero=0."
            )
        if self.dp is not None and self.dp != len(self.replicas):
            raise PlanError(
                f"Plan.dp={self.dp} but Plan.replicas lists {len(self.replicas)} replicas: leave Plan.dp unset."
            )
        if self.pipeline.schedule not in SINGLE_STAGE_SCHEDULES:
            raise PlanError(
                f"Plan.pipeline.schedule={self.pipeline.schedule!r}: replicas of different depth run one stage per "
                f"rank; use {' or '.join(SINGLE_STAGE_SCHEDULES)}."
            )
        ends = {r.stages[-1][1] for r in self.replicas}
        if len(ends) > 1:
            raise PlanError(
                f"Plan.replicas end at layers {sorted(ends)}: every replica must hold the whole model "
                "(its last stage ends at the model's last layer)."
            )
        for i, replica in enumerate(self.replicas):
            if replica.depth > 1:
                try:
                    dataclasses.replace(self.pipeline, stages=replica.stages).check_schedule(replica.depth)
                except PlanError as exc:
                    raise PlanError(f"Plan.replicas[{i}]: {exc}") from None

    # ----------------------------------------------------------------- sizes
    @property
    def ulysses_size(self) -> int:
        """Ranks per Ulysses group: ``sp`` for all_to_all; 1 for split_gather, which reuses tp's ranks."""
        return self.sp if self.sp_mode == "all_to_all" else 1

    @property
    def model_parallel_size(self) -> int:
        """Ranks that together hold one replica of the model (tp × pp × Ulysses sp)."""
        return self.tp * self.pp * self.ulysses_size

    def resolve(self, world_size: int) -> Plan:
        """Return this Plan with ``dp`` filled in for ``world_size`` ranks, checking the product and
        that the resolved sizes compose (:meth:`check_composable`)."""
        if self.replicas is not None:
            return self._resolve_replicas(world_size)
        mp = self.model_parallel_size
        dp = self.dp
        ranks, job = world_size, f"the job has {world_size} ranks"
        if self.groups is not None:
            if self.groups.uneven:  # set only with fault_tolerant: each group is its own job, laid out alone
                raise PlanError(
                    f"Plan.groups.sizes={list(self.groups.sizes or ())} differ, so each group is its own job: resolve "
                    "the Plan without groups on one group's ranks (the Booster does)."
                )
            count = self.groups.count
            ranks = self.groups.group_worlds(world_size)[0]
            job = f"each of the {count} groups has {ranks} ranks"
        if dp is None:
            if ranks % mp:
                raise PlanError(
                    f"{job}, which tp×pp×sp={mp} does not divide: change Plan.tp/pp/sp or the number of ranks."
                )
            dp = ranks // mp
        if dp * mp != ranks:
            raise PlanError(
                f"Plan.dp×tp×pp×sp = {dp}×{self.tp}×{self.pp}×{self.ulysses_size} = {dp * mp} but {job}: "
                "make the product equal (or leave Plan.dp unset)."
            )
        if self.dp_shares is not None and len(self.dp_shares) != dp:
            raise PlanError(
                f"Plan.dp_shares has {len(self.dp_shares)} entries but the data-parallel size is {dp} "
                f"({ranks} ranks / tp×pp×sp={mp}): give one share per data-parallel rank."
            )
        if dp % self.ep:
            raise PlanError(
                f"Plan.ep={self.ep} must divide the data-parallel size dp={dp}: expert parallelism splits the "
                "experts over data-parallel ranks; choose an ep that divides dp."
            )
        self._check_rank_lists(world_size)
        resolved = dataclasses.replace(self, dp=dp)
        resolved.check_composable()
        return resolved

    def _resolve_replicas(self, world_size: int) -> Plan:
        assert self.replicas is not None
        depths = [r.depth for r in self.replicas]
        if sum(depths) != world_size:
            raise PlanError(
                f"Plan.replicas need {sum(depths)} ranks (depths {'+'.join(map(str, depths))}) but the job has "
                f"{world_size}: launch {sum(depths)} ranks or change the replicas."
            )
        self._check_rank_lists(world_size)
        if self.groups is not None:
            raise NotSupportedYet(
                "Plan.groups with Plan.replicas is not supported yet: lay each group out with data, ZeRO, tensor or "
                "pipeline parallelism."
            )
        return dataclasses.replace(self, dp=len(self.replicas))

    def _check_rank_lists(self, world_size: int) -> None:
        if self.rank_devices is not None and len(self.rank_devices) != world_size:
            raise PlanError(
                f"Plan.rank_devices names {len(self.rank_devices)} devices but the job has {world_size} ranks."
            )
        if self.placement is not None and (len(self.placement) != world_size or len(set(self.placement)) != world_size):
            raise PlanError(
                f"Plan.placement must name {world_size} different cluster devices, one per rank (the device each "
                f"rank runs on; devices left out of the job are simply not named), got {list(self.placement)}."
            )

    @property
    def pipelined(self) -> bool:
        """Whether some rank holds only part of the model (pipeline stages): training goes through
        ``Booster.execute_pipeline``."""
        return self.pp > 1 or (self.replicas is not None and any(r.depth > 1 for r in self.replicas))

    def mesh_shape(self) -> tuple[tuple[int, ...], tuple[str, ...]]:
        """Sizes and names of the device mesh of a resolved grid Plan: ranks are laid out row-major
        over (pp, dp, tp) or (pp, dp, sp), pp outermost (stages talk point-to-point, the cheapest
        traffic for slow links), then dp; the ranks of one tp or sp group are neighbours."""
        if self.dp is None:
            raise PlanError("Plan.dp is unknown: call Plan.resolve(world_size) first.")
        if self.replicas is not None:
            raise PlanError(
                "Plan.replicas has no device mesh: its replicas differ in depth, so ranks form no dp × pp grid."
            )
        shape, names = ([self.dp // self.ep, self.ep], ["dp_rep", "ep"]) if self.ep > 1 else ([self.dp], ["dp"])
        if self.tp > 1:
            shape, names = [*shape, self.tp], [*names, "tp"]
        elif self.ulysses_size > 1:
            shape, names = [self.dp, self.sp], ["dp", "sp"]
        if self.pp > 1:
            shape, names = [self.pp, *shape], ["pp", *names]
        if self.groups is not None:  # outermost: a group's ranks are neighbours, like a region's
            shape, names = [self.groups.count, *shape], ["group", *names]
        return tuple(shape), tuple(names)

    def coords(self, rank: int) -> RankCoords:
        """Where ``rank`` sits in a resolved Plan: its pipeline stage, data-parallel index (its
        replica under Plan.replicas) and tp / Ulysses sp index (the inverse of :meth:`rank_at`)."""
        if self.replicas is not None:
            first = 0
            for index, replica in enumerate(self.replicas):
                if rank < first + replica.depth:
                    return RankCoords(pp=rank - first, dp=index)
                first += replica.depth
            raise PlanError(f"rank {rank} is past the {first} ranks of Plan.replicas.")
        if self.dp is None:
            raise PlanError("Plan.dp is unknown: call Plan.resolve(world_size) first.")
        group, rank = divmod(rank, self.group_size)
        stage, dp, inner = grid_coords(rank, self.dp, self.tp * self.ulysses_size)
        return RankCoords(
            pp=stage, dp=dp, tp=inner if self.tp > 1 else 0, sp=inner if self.ulysses_size > 1 else 0, group=group
        )

    def rank_at(self, coords: RankCoords) -> int:
        """The global rank at ``coords`` (the inverse of :meth:`coords`)."""
        if self.replicas is not None:
            return sum(r.depth for r in self.replicas[: coords.dp]) + coords.pp
        if self.dp is None:
            raise PlanError("Plan.dp is unknown: call Plan.resolve(world_size) first.")
        inner = (coords.pp * self.dp + coords.dp) * self.tp * self.ulysses_size + coords.tp + coords.sp
        return coords.group * self.group_size + inner

    @property
    def group_size(self) -> int:
        """Ranks per group of a resolved grid Plan (every rank when there are no Plan.groups)."""
        if self.dp is None:
            raise PlanError("Plan.dp is unknown: call Plan.resolve(world_size) first.")
        return self.dp * self.model_parallel_size

    def device_of(self, rank: int) -> int:
        """The cluster device (file order) that ``rank`` runs on."""
        return self.placement[rank] if self.placement is not None else rank

    def shares(self, dp: int | None = None) -> tuple[int, ...]:
        """Relative samples per data-parallel rank (all ones when the plan is even)."""
        if self.replicas is not None:
            return tuple(r.share for r in self.replicas)
        dp = dp or self.dp
        if dp is None:
            raise PlanError("Plan.dp is unknown: call Plan.resolve(world_size) first.")
        return self.dp_shares if self.dp_shares is not None else (1,) * dp

    def samples_per_rank(self, global_batch_size: int) -> list[int]:
        """Samples each data-parallel rank (each replica) takes of every global batch, by share."""
        return split_batch(global_batch_size, self.shares())

    def batch_split(self, global_batch_size: int) -> list[int]:
        """Samples of every global batch per data-parallel rank of the whole job: group after group under
        Plan.groups (split by ``groups.shares``, then by ``dp_shares`` inside each group)."""
        if self.groups is None:
            return self.samples_per_rank(global_batch_size)
        per_group = split_batch(global_batch_size, self.groups.group_shares())
        return [n for samples in per_group for n in split_batch(samples, self.shares())]

    def data_rank(self, rank: int) -> int:
        """Which entry of :meth:`batch_split` ``rank`` reads."""
        coords = self.coords(rank)
        return coords.group * len(self.shares()) + coords.dp

    def replica_ranks(self, index: int) -> list[int]:
        """The global ranks of replica ``index`` of a ``Plan.replicas`` plan, in stage order."""
        assert self.replicas is not None
        return [self.rank_at(RankCoords(pp=s, dp=index)) for s in range(self.replicas[index].depth)]

    def check_composable(self) -> None:
        """Refuse (resolved) layouts whose pieces exist but do not compose yet; run by resolve()."""
        if self.groups is not None and self.groups.sync == "every_step" and (self.tp > 1 or self.ulysses_size > 1):
            raise NotSupportedYet(
                "Plan.groups.sync='every_step' with tensor or Ulysses sequence parallelism inside the groups is not "
                "supported yet: use data parallelism or ZeRO inside them, or sync: diloco."
            )
        if self.groups is not None and self.groups.sync == "every_step" and self.pp > 1:
            raise NotSupportedYet(
                "Plan.groups.sync='every_step' with pipeline stages inside the groups is not supported yet: use "
                "sync: diloco or streaming (each stage syncs its own layers), or no pipeline."
            )
        if self.ulysses_size > 1 and self.tp > 1:
            raise NotSupportedYet(
                f"Plan.sp={self.sp} (all_to_all) together with Plan.tp={self.tp} is not supported yet: use one, "
                "or sp_mode='split_gather' (sequence parallelism inside the tp group)."
            )
        if self.pp > 1 and self.sp > 1 and self.sp_mode == "split_gather":
            raise NotSupportedYet(
                f"Plan.pp={self.pp} with split/gather sequence parallelism is not supported yet: use "
                "sp_mode='all_to_all' (Ulysses) with pp, or split/gather without pp."
            )
        if self.pp > 1 and self.offload:
            raise NotSupportedYet(f"Plan.offload with Plan.pp={self.pp} is not supported yet: use offload=False.")
        if self.ep > 1:
            unsupported = {
                "offload": self.offload,
                "sp": self.sp > 1,
                "groups": self.groups is not None,
            }
            other = [f"Plan.{name}={getattr(self, name)!r}" for name, used in unsupported.items() if used]
            if other:
                raise NotSupportedYet(
                    f"Plan.ep={self.ep} with {', '.join(other)} is not supported yet: expert parallelism runs with "
                    "DDP or ZeRO-1/2/3, tensor parallelism and pipeline stages (no offload) for now; "
                    "use ep=1 for the others."
                )
        if self.tp > 1 and self.offload:
            raise NotSupportedYet(f"Plan.offload with Plan.tp={self.tp} is not supported yet: use offload=False.")

    # --------------------------------------------------------- serialisation
    def group_plan(self, group: int) -> Plan:
        """The Plan group ``group`` of fault-tolerant ``groups`` runs as its own job: these fields, without the
        groups, with what ``groups.layouts`` sets for that group (a bad value is named by its group)."""
        assert self.groups is not None
        fields = self.groups.layout_fields(group)
        try:
            if "pipeline" in fields:
                fields["pipeline"] = dataclasses.replace(self.pipeline, **fields["pipeline"])
            return dataclasses.replace(self, groups=None, **fields)
        except PlanError as exc:
            raise PlanError(f"Plan.groups.layouts[{group}]: {exc}") from None

    def to_dict(self) -> dict[str, Any]:
        """Plain dict of the Plan (tuples become lists), ready for JSON/YAML."""
        return json.loads(json.dumps(dataclasses.asdict(self)))

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Plan:
        """Build a Plan from a dict; unknown keys are errors naming the nearest valid key."""
        return _from_dict(cls, data, "")

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)

    @classmethod
    def from_json(cls, text: str) -> Plan:
        return cls.from_dict(_parse(json.loads, json.JSONDecodeError, "JSON", text))

    def to_yaml(self) -> str:
        import yaml

        return yaml.safe_dump(self.to_dict(), sort_keys=False)

    @classmethod
    def from_yaml(cls, text: str) -> Plan:
        return cls.from_dict(_parse(lambda t: load_yaml(t, "Plan YAML"), InputError, "YAML", text))

    def save(self, path: str | Path) -> None:
        """Write the Plan as YAML (``.yaml``/``.yml``) or JSON (anything else)."""
        path = Path(path)
        text = self.to_yaml() if path.suffix in (".yaml", ".yml") else self.to_json()
        path.write_text(text)

    @classmethod
    def load(cls, path: str | Path) -> Plan:
        """Read a Plan file (YAML, or JSON for other suffixes); every mistake names the file."""
        try:
            text = read_text(path, "Plan file")
            return cls.from_yaml(text) if Path(path).suffix in (".yaml", ".yml") else cls.from_json(text)
        except (InputError, PlanError) as exc:
            message = str(exc)
            raise PlanError(message if str(path) in message else f"Plan file '{path}': {message}") from None


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


def _replicas_from(value: Any) -> tuple[Replica, ...]:
    """``Plan.replicas`` as Replica objects (dicts from JSON/YAML too), each checked."""
    if not isinstance(value, (tuple, list)) or not value:
        raise PlanError(f"Plan.replicas must be a non-empty list of replicas (stages, share), got {value!r}.")
    out = []
    for i, item in enumerate(value):
        if isinstance(item, dict) and "stages" not in item:
            raise PlanError(f"Plan.replicas[{i}] has no stages: give its layer ranges, e.g. stages: [[0, 8]].")
        replica = _from_dict(Replica, item, f"replicas[{i}]") if isinstance(item, dict) else item
        if not isinstance(replica, Replica):
            raise PlanError(f"Plan.replicas[{i}] must be a Replica or a mapping with stages and share, got {item!r}.")
        _check_ranges(f"replicas[{i}].stages", replica.stages)
        _check_int(f"replicas[{i}].share", replica.share, maximum=MAX_COUNT)
        out.append(replica)
    return tuple(out)


def _parse(load: Any, error: type[Exception], fmt: str, text: str) -> Any:
    try:
        return load(text)
    except RecursionError:
        raise PlanError(f"Plan {fmt} nests too deeply to be a Plan.") from None
    except error as exc:
        raise PlanError(f"Plan {fmt} is malformed: {str(exc)[:300]}") from None


def _from_dict(cls: type, data: Any, prefix: str) -> Any:
    where = f"Plan.{prefix}" if prefix else "Plan"
    if not isinstance(data, dict):
        raise PlanError(f"{where} must be a mapping of field names to values, got {type(data).__name__}.")
    names = {f.name for f in fields(cls)}
    for key in data:
        if key not in names:
            raise PlanError(
                f"{where} has no field {key!r}{nearest(str(key), names)}; valid fields: {', '.join(sorted(names))}."
            )
    return cls(**{k: as_tuple(v) for k, v in data.items()})
