"""Pipeline stages in a Plan: how the layers are cut and scheduled (:class:`PipelineSpec`), and the
replicas of different depth that replace a dp × pp grid (:class:`Replica`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tessera.errors import PlanError
from tessera.inputs import as_tuple
from tessera.plan.checks import (
    MAX_COUNT,
    ROUND_SCHEDULES,
    SCHEDULES,
    SINGLE_STAGE_SCHEDULES,
    V_SCHEDULES,
    check_choice,
    check_int,
    check_ranges,
    from_mapping,
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
        check_int("pipeline.microbatches", self.microbatches, maximum=MAX_COUNT)
        check_choice("pipeline.schedule", self.schedule, SCHEDULES)
        if self.stages is not None:
            check_ranges("pipeline.stages", self.stages)

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
    relative number of samples of every global batch. ``tp``: tensor-parallel ranks holding the
    replica (a whole model split over the ``tp`` devices of one node, next to replicas of one
    device: tp8 inside 8-device nodes, tp1 on single-device ones); a pipelined replica keeps tp 1.

    Example (the Zorse shape: one fast device holds all 8 layers, two slow ones split them):
        >>> plan = Plan(replicas=(Replica([(0, 8)], share=2), Replica([(0, 4), (4, 8)])), pipeline={"microbatches": 2})
        >>> plan.resolve(world_size=3).shares()
        (2, 1)
    """

    stages: tuple[tuple[int, int], ...]
    share: int = 1
    tp: int = 1

    def __post_init__(self) -> None:
        object.__setattr__(self, "stages", as_tuple(self.stages))

    @property
    def depth(self) -> int:
        """Pipeline stages of this replica."""
        return len(self.stages)

    @property
    def size(self) -> int:
        """Ranks of this replica: ``tp`` per stage."""
        return self.depth * self.tp


def replicas_from(value: Any) -> tuple[Replica, ...]:
    """``Plan.replicas`` as Replica objects (dicts from JSON/YAML too), each checked."""
    if not isinstance(value, (tuple, list)) or not value:
        raise PlanError(f"Plan.replicas must be a non-empty list of replicas (stages, share), got {value!r}.")
    out = []
    for i, item in enumerate(value):
        if isinstance(item, dict) and "stages" not in item:
            raise PlanError(f"Plan.replicas[{i}] has no stages: give its layer ranges, e.g. stages: [[0, 8]].")
        replica = from_mapping(Replica, item, f"replicas[{i}]") if isinstance(item, dict) else item
        if not isinstance(replica, Replica):
            raise PlanError(f"Plan.replicas[{i}] must be a Replica or a mapping with stages and share, got {item!r}.")
        check_ranges(f"replicas[{i}].stages", replica.stages)
        check_int(f"replicas[{i}].share", replica.share, maximum=MAX_COUNT)
        check_int(f"replicas[{i}].tp", replica.tp, maximum=MAX_COUNT)
        out.append(replica)
    return tuple(out)
