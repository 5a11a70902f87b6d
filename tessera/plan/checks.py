"""The Plan's vocabulary and the checks its fields share: names that may be chosen, upper bounds that
catch a typo, and one error style (the field, what it got, how to fix it).

Nothing here knows a whole Plan; :mod:`.fields`, :mod:`.pipeline` and :mod:`.groups` build on it.
"""

from __future__ import annotations

import math
from dataclasses import fields
from typing import Any

from tessera.errors import PlanError, nearest
from tessera.inputs import as_tuple, shown

PRECISIONS = ("fp32", "bf16", "fp16", "fp8")
FP8_RECIPES = ("tensorwise", "rowwise")  # torchao's float8 scaling: one scale per tensor, or per row
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
RECOMPUTE = ("none", "selective", "full", "ops")  # ops: matmul outputs kept, the rest recomputed
COMPILE = ("none", "blocks")  # "blocks": each repeated block compiled on its own (regional compilation)
SP_MODES = ("split_gather", "all_to_all")
DEVICES = ("auto", "cpu", "cuda")

# Upper bounds: what a typo (an extra zero) may ask for. tp/sp and pp keep the limits the
# config had before it took the Plan's own schema (a head count, a layer count).
MAX_SIZE = 1 << 20  # data-parallel ranks
MAX_GROUP = 1 << 16  # tensor- or sequence-parallel ranks
MAX_STAGES = 1024  # pipeline ranks (every stage needs a layer)
MAX_COUNT = 1 << 24  # micro-batches, shares


def check_int(name: str, value: Any, minimum: int = 1, maximum: int = MAX_SIZE) -> None:
    """Refuse ``Plan.<name>`` unless it is an integer from ``minimum`` to ``maximum``."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise PlanError(f"Plan.{name} must be an integer, got {shown(value)} ({type(value).__name__}).")
    if value < minimum:
        raise PlanError(f"Plan.{name} must be >= {minimum}, got {value}.")
    if value > maximum:
        raise PlanError(f"Plan.{name} must be at most {maximum}, got {value}.")


def check_choice(name: str, value: Any, choices: tuple[str, ...]) -> None:
    """Refuse ``Plan.<name>`` unless it is one of ``choices`` (naming the nearest)."""
    if value not in choices:
        hint = nearest(str(value), choices)
        raise PlanError(f"Plan.{name}={value!r} is not one of {', '.join(choices)}{hint}.")


def check_positive_ints(name: str, values: Any, what: str) -> None:
    """Refuse ``Plan.<name>`` unless it is a non-empty list of positive integers (``what``: the rule, said of a
    bad entry)."""
    if not isinstance(values, tuple) or not values:
        raise PlanError(f"Plan.{name} must be a list of positive integers, got {values!r}.")
    for i, value in enumerate(values):
        if isinstance(value, bool) or not isinstance(value, int) or not 0 < value <= MAX_COUNT:
            raise PlanError(f"Plan.{name}[{i}]={value!r}: {what}.")


def check_bool(name: str, value: Any) -> None:
    if not isinstance(value, bool):
        raise PlanError(f"Plan.{name} must be true or false, got {shown(value)}.")


def positive_int(name: str, value: Any, maximum: int) -> None:
    """Refuse ``Plan.<name>`` unless it is an integer from 1 to ``maximum`` (one message for both ends)."""
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= maximum:
        raise PlanError(f"Plan.{name} must be an integer from 1 to {maximum}, got {shown(value)}.")


def finite_number(name: str, value: Any, positive: bool = False) -> None:
    """Refuse ``Plan.<name>`` unless it is a finite number >= 0 (> 0 when ``positive``)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise PlanError(f"Plan.{name} must be a finite number, got {shown(value)}.")
    if value < 0 or (positive and value == 0):
        raise PlanError(f"Plan.{name} must be {'> 0' if positive else '>= 0'}, got {value}.")


def check_ranges(name: str, stages: Any) -> None:
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


def from_mapping(cls: type, data: Any, prefix: str) -> Any:
    """``cls`` (a dataclass of the Plan) from a mapping; an unknown key names the nearest valid one."""
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
