"""Groups of ranks that train apart and meet at an outer synchronisation (regions joined by slow links).

``Plan.groups`` splits the ranks into ``count`` groups of equal size, in rank order (group g holds
ranks ``g × size … (g + 1) × size − 1``). Inside a group the rest of the Plan applies as it does to a
whole job (dp, ZeRO, tp, uneven shares); across groups, ``sync`` says how they meet:

- ``every_step``: synchronous training, the gradients averaged over every group at every step,
  hierarchically: reduced inside each group, only a slice per rank across groups, then gathered
  inside (:mod:`tessera.across.hierarchical`).
- ``diloco`` (Douillard et al., 2023): each group takes ``inner_steps`` (H) steps with its own
  optimizer; then the groups average their parameter change since the last sync (the outer
  gradient) and an outer optimizer, SGD with Nesterov momentum by default (lr 0.7, momentum 0.9),
  applies it to the weights they last agreed on. The only traffic across groups is one
  all-reduce of the parameters every H steps.
- ``streaming`` (Streaming DiLoCo, Douillard et al., 2025): the layers in ``fragments`` runs
  (which must divide the layer count), one synced every ``inner_steps / fragments`` steps in turn, so each still
  syncs every H steps and the link carries a fragment at a time. With ``delay`` τ > 0 the
  transfer overlaps the next τ inner steps; when it lands, the fragment becomes the new agreed
  weights plus what those τ steps changed locally (the paper mixes the two with a factor α).
- ``none``: isolated islands that never meet (merge their checkpoints afterwards).

``compression`` (``bf16``, ``int8`` or ``int4``, with error feedback) shrinks what DiLoCo and
Streaming DiLoCo send (:mod:`tessera.across.compress`).

``shares`` splits each global batch over the groups (samples, as ``dp_shares`` does inside one).

``fault_tolerant``: each group is its own job and they meet through torchft's quorum, so a group that
fails does not stop the others and one that comes back takes their state
(:mod:`tessera.across.torchft`; ``tessera train`` starts a Lighthouse and one job per group).
Such groups may differ in size (``sizes``: ranks per group, e.g. a region of 8 and one of 4) and in
layout (``layouts``: per group, the Plan fields it sets for itself, e.g. ZeRO-3 in the small region,
pipeline stages in another and plain data parallelism in the big one). Groups that differ sync
through as many ranks as the smallest has, in canonical slots (:mod:`tessera.across.slots`).

Example:
    >>> plan = Plan(zero=2, groups=Groups(count=2, sync="diloco", inner_steps=50))
    >>> plan.resolve(world_size=8).dp   # four data-parallel ranks in each of the two groups
    4
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tessera.errors import PlanError, nearest
from tessera.inputs import as_tuple, shown
from tessera.plan import grid
from tessera.plan.checks import check_bool, finite_number, positive_int

SYNCS = ("every_step", "diloco", "streaming", "none")
PIPELINE_FIELDS = ("microbatches", "stages", "schedule")


@dataclass(frozen=True)
class InnerLayout:
    """What one fault-tolerant group lays out differently from the Plan's other fields (None: as they say).

    Example:
        >>> Groups(count=2, fault_tolerant=True, layouts=({"zero": 3}, {}))
    """

    zero: int | None = None
    tp: int | None = None
    pp: int | None = None
    offload: bool | None = None
    recompute: str | None = None
    dp_shares: tuple[int, ...] | None = None  # samples per data-parallel rank of this group
    placement: tuple[int, ...] | None = None  # the device each of the group's ranks runs on, in its own file
    # the pipeline's (Plan.pipeline):
    microbatches: int | None = None
    stages: tuple[tuple[int, int], ...] | None = None
    schedule: str | None = None

    def fields(self) -> dict[str, Any]:
        """The Plan fields this group sets (``microbatches``, ``stages``, ``schedule`` as its pipeline section)."""
        out = {k: v for k, v in vars(self).items() if v is not None and k not in PIPELINE_FIELDS}
        pipeline = {k: getattr(self, k) for k in PIPELINE_FIELDS if getattr(self, k) is not None}
        if pipeline:
            out["pipeline"] = pipeline
        return out


def _inner_layout(value: Any, where: str) -> InnerLayout:
    if isinstance(value, InnerLayout):
        return value
    names = tuple(InnerLayout.__dataclass_fields__)
    if not isinstance(value, dict):
        raise PlanError(f"{where} must be a mapping of Plan fields ({', '.join(names)}), got {shown(value)}.")
    for key in value:
        if key not in names:
            raise PlanError(
                f"{where} has no field {key!r}{nearest(str(key), names)}: a group may set {', '.join(names)} "
                "(sequence parallelism inside groups that differ is not supported yet)."
            )
    # The values are the Plan's own: Plan checks them, with the rest of the Plan, when it holds these groups.
    return InnerLayout(**{k: as_tuple(v) for k, v in value.items()})


COMPRESSIONS = ("none", "bf16", "int8", "int4")  # tessera.across.compress
MAX_GROUPS = 1 << 16
MAX_INNER_STEPS = 1 << 24


@dataclass(frozen=True)
class Groups:
    """Ranks split into ``count`` equal groups that synchronise as ``sync`` says (module docstring)."""

    count: int = 2
    sync: str = "diloco"
    inner_steps: int = 50
    outer_lr: float = 0.7
    outer_momentum: float = 0.9
    nesterov: bool = True
    shares: tuple[int, ...] | None = None
    fragments: int = 1
    delay: int = 0
    compression: str = "none"
    fault_tolerant: bool = False
    sizes: tuple[int, ...] | None = None
    layouts: tuple[InnerLayout, ...] | None = None

    def __post_init__(self) -> None:
        for name in ("shares", "sizes", "layouts"):
            if isinstance(getattr(self, name), list):
                object.__setattr__(self, name, tuple(getattr(self, name)))
        if self.layouts is not None:
            if not isinstance(self.layouts, tuple) or len(self.layouts) != self.count:
                raise PlanError(
                    f"Plan.groups.layouts must list one mapping per group ({self.count}), e.g. [{{zero: 3}}, {{}}], "
                    f"got {shown(self.layouts)}."
                )
            layouts = tuple(_inner_layout(v, f"Plan.groups.layouts[{i}]") for i, v in enumerate(self.layouts))
            object.__setattr__(self, "layouts", layouts)
        positive_int("groups.count", self.count, MAX_GROUPS)
        if self.sync not in SYNCS:
            raise PlanError(
                f"Plan.groups.sync={self.sync!r} is not one of {', '.join(SYNCS)}{nearest(str(self.sync), SYNCS)}."
            )
        positive_int("groups.inner_steps", self.inner_steps, MAX_INNER_STEPS)
        finite_number("groups.outer_lr", self.outer_lr, positive=True)
        finite_number("groups.outer_momentum", self.outer_momentum)
        if not self.outer_momentum < 1:
            raise PlanError(f"Plan.groups.outer_momentum must be in [0, 1), got {self.outer_momentum}.")
        check_bool("groups.nesterov", self.nesterov)
        if self.nesterov and self.outer_momentum == 0:
            raise PlanError("Plan.groups.nesterov=true needs outer_momentum > 0 (Nesterov is a kind of momentum).")
        positive_int("groups.fragments", self.fragments, MAX_INNER_STEPS)
        if isinstance(self.delay, bool) or not isinstance(self.delay, int) or self.delay < 0:
            raise PlanError(f"Plan.groups.delay must be a whole number of inner steps >= 0, got {shown(self.delay)}.")
        if self.sync != "streaming" and (self.fragments != 1 or self.delay):
            raise PlanError(
                f"Plan.groups.fragments={self.fragments} and delay={self.delay} are Streaming DiLoCo's: set "
                "sync: streaming, or leave them at 1 and 0."
            )
        if self.inner_steps % self.fragments:
            raise PlanError(
                f"Plan.groups.fragments={self.fragments} does not divide inner_steps={self.inner_steps}: fragments "
                "take turns, one every inner_steps / fragments steps."
            )
        if self.delay >= self.inner_steps // self.fragments:
            raise PlanError(
                f"Plan.groups.delay={self.delay} must be below inner_steps / fragments = "
                f"{self.inner_steps // self.fragments}: a fragment's transfer lands before the next one leaves."
            )
        if self.compression not in COMPRESSIONS:
            hint = nearest(str(self.compression), COMPRESSIONS)
            raise PlanError(
                f"Plan.groups.compression={self.compression!r} is not one of {', '.join(COMPRESSIONS)}{hint}."
            )
        if self.compression != "none" and self.sync not in ("diloco", "streaming"):
            raise PlanError(
                f"Plan.groups.compression={self.compression!r} compresses the outer gradients of sync: diloco or "
                f"streaming; sync: {self.sync} sends none."
            )
        _per_group("shares", self.shares, self.count, f"one positive integer per group ({self.count})")
        _per_group("sizes", self.sizes, self.count, f"the ranks of each of the {self.count} groups")
        if self.uneven and not self.fault_tolerant:
            raise PlanError(
                f"Plan.groups.sizes={list(self.sizes or ())} differ: groups of different sizes run as separate jobs, "
                "so set fault_tolerant: true (or make the sizes equal)."
            )
        check_bool("groups.fault_tolerant", self.fault_tolerant)
        if self.fault_tolerant and self.sync not in ("diloco", "streaming"):
            raise PlanError(
                f"Plan.groups.fault_tolerant=true meets the groups at DiLoCo's outer syncs; sync: {self.sync} has "
                "none (every_step would need a quorum every step): use sync: diloco or streaming."
            )
        if self.layouts is not None and not self.fault_tolerant:
            raise PlanError(
                "Plan.groups.layouts lays each group out its own way, so each group is its own job: set "
                "fault_tolerant: true (or drop layouts and lay every group out alike)."
            )

    def group_shares(self) -> tuple[int, ...]:
        """Relative samples per group (all ones when even)."""
        return self.shares if self.shares is not None else (1,) * self.count

    @property
    def uneven(self) -> bool:
        """Whether the groups differ in size."""
        return self.sizes is not None and len(set(self.sizes)) > 1

    @property
    def differ(self) -> bool:
        """Whether the groups differ in size or layout (then they meet in canonical slots)."""
        return self.uneven or (self.layouts is not None and len(set(self.layouts)) > 1)

    def layout_fields(self, group: int) -> dict[str, Any]:
        """The Plan fields group ``group`` sets for itself (none without ``layouts``)."""
        return self.layouts[group].fields() if self.layouts is not None else {}

    def group_worlds(self, ranks: int) -> list[int]:
        """Ranks of each group when ``ranks`` are launched for all of them (:func:`tessera.plan.grid.group_worlds`)."""
        return grid.group_worlds(self, ranks)


def _per_group(name: str, values: Any, count: int, what: str) -> None:
    """Refuse ``groups.<name>`` unless it is absent or ``count`` positive integers (``what`` says so)."""
    if values is None:
        return
    if not isinstance(values, tuple) or len(values) != count:
        raise PlanError(f"Plan.groups.{name} must list {what}, got {shown(values)}.")
    for i, value in enumerate(values):
        positive_int(f"groups.{name}[{i}]", value, MAX_INNER_STEPS)
