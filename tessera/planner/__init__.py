"""The planner: per-layer costs (profile, costs), the cost model and simulator that judge a layout,
and the search that picks one. :func:`plan_for` is the one call; ``tessera.Auto`` wraps it.

Example:
    >>> best = plan_for("cluster.yaml", model, global_batch_size=64, top=3)
    >>> best[0].plan, best[0].estimate.tokens_per_s, best[0].estimate.bottleneck
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from torch import nn

from tessera.cluster.spec import Cluster
from tessera.errors import PlanError
from tessera.planner.costs import ModelCosts
from tessera.planner.experts import expert_candidate, expert_costs
from tessera.planner.outer import outer_candidates, unlike_region_candidates
from tessera.planner.precision import choose_precision
from tessera.planner.search import Candidate, search
from tessera.planner.subsets import on_full_cluster, subsets

EVERY_SHAPE = 10_000  # a "top" no search reaches


def sequence_length(model: nn.Module) -> int:
    """The model's maximum sequence length, from its config."""
    config = getattr(model, "config", None)
    for name in ("max_seq_len", "n_positions", "max_position_embeddings"):
        value = getattr(config, name, None)
        if isinstance(value, int):
            return value
    raise PlanError("the planner needs seq_len: the model's config names no max_seq_len / n_positions.")


def plan_for(
    cluster: Cluster | str | Path,
    model: nn.Module,
    global_batch_size: int,
    seq_len: int | None = None,
    precision: str = "fp32",
    top: int = 5,
    costs: ModelCosts | None = None,
    pin_precision: bool = False,
    use_every_device: bool = False,
) -> list[Candidate]:
    """The ``top`` fastest plans for ``model`` on ``cluster`` (build the model on the meta device:
    only its shapes are read). ``costs`` replaces the analytic per-layer costs (e.g. a profile).
    ``precision`` bf16 (or "auto") beside devices without bf16 plans fp16 with loss scaling unless
    ``pin_precision`` (:func:`~tessera.planner.precision.choose_precision`; the ``notes`` say so).
    Plans that leave the slowest devices out compete too (:mod:`~tessera.planner.subsets`; their
    ``notes`` and ``Plan.placement`` say which) unless ``use_every_device``. A model with experts also
    gets each layout with its experts split over the data-parallel ranks and placed by device speed and
    memory (:mod:`~tessera.planner.experts`) where that is predicted faster."""
    cluster = cluster if isinstance(cluster, Cluster) else Cluster.load(cluster)
    precision, note = choose_precision(cluster, precision, pin_precision)
    if costs is None:
        costs = ModelCosts.from_model(model, seq_len or sequence_length(model), precision)
    elif costs.precision != precision:
        costs = costs.with_precision(precision)
    experts = expert_costs(model, precision)
    # With experts, every shape's best layout is kept: a flat data-parallel one may win once its experts are split
    found = search(cluster, costs, global_batch_size, top=top if experts is None else EVERY_SHAPE)
    found += outer_candidates(cluster, costs, global_batch_size, top)  # regions alike: a group each
    found += unlike_region_candidates(cluster, costs, global_batch_size)  # not alike: a job each, its own layout
    if not use_every_device:
        for sub, kept in subsets(cluster, precision):  # without the slowest devices: can a smaller job win?
            try:
                smaller = search(sub, costs, global_batch_size, top=top)
            except PlanError:  # does not fit, or the batch is too small for it
                continue
            found += [on_full_cluster(c, kept, cluster) for c in smaller]
    if experts is not None:  # each layout also with its experts split over its data ranks, placed by speed
        seq = seq_len or sequence_length(model)
        split = [expert_candidate(c, cluster, experts, seq, global_batch_size, precision) for c in found]
        found += [c for c in split if c is not None]
    found = distinct(sorted(found, key=lambda c: c.estimate.step_s))[:top]
    return [replace(c, notes=(*c.notes, note)) for c in found] if note else found


def distinct(found: list[Candidate]) -> list[Candidate]:
    """``found`` without the plans a reader could not tell apart from an earlier one: the same layout and
    predicted step, on devices swapped for alike ones (e.g. two alike nodes trading stages)."""
    seen, kept = set(), []
    for c in found:
        fields = c.plan.to_dict()
        fields.pop("placement", None)
        fields.pop("rank_devices", None)
        key = (repr(sorted(fields.items())), round(c.estimate.step_s, 12), tuple(sorted(_types(c))))
        if key not in seen:
            seen.add(key)
            kept.append(c)
    return kept


def _types(c: Candidate) -> list[str]:
    """The device type of each rank, in rank order (swapping alike devices keeps it; swapping unlike ones not)."""
    return [label.split(":")[-1] for label in c.plan.rank_devices or ()]


__all__ = ["Candidate", "ModelCosts", "plan_for", "sequence_length"]
