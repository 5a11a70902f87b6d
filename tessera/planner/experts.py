"""Experts in the plan: what they cost, and which rank holds how many (``Plan.ep``, ``Plan.expert_shares``).

A mixture-of-experts block computes only its tokens' ``top_k`` experts, so its FLOPs are those of the
active parameters (:func:`tessera.models.hf_experts.active_params`, used by :class:`~tessera.planner.costs.ModelCosts`).
Under expert parallelism the expert compute moves: an ep rank runs the slots routed to *its* experts,
from every rank of its ep group, and the rows travel there and back by all-to-all (twice in the forward,
twice in the backward, per MoE layer). Every rank waits at each exchange for the slowest, so a rank of
half the speed holding as many experts as the others sets the pace: :func:`place_experts` gives each
rank experts in proportion to its speed (and no more than its memory holds), and
:func:`expert_seconds` predicts the expert compute and the exchanges of a step for a given placement,
assuming the router spreads slots evenly over the experts (the balance loss or bias is what makes that
true). :func:`with_experts` turns a planned layout into one with experts split over its data-parallel
ranks, placed by speed, when that is predicted faster.

Example:
    >>> place_experts([4.0, 4.0, 2.0, 2.0], experts=8)
    (3, 3, 1, 1)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

from torch import nn

from tessera.cluster.spec import USABLE_MEMORY, Cluster, Link
from tessera.data.sharding import split_batch
from tessera.models.hf_experts import expert_modules, top_k_of
from tessera.plan import Plan
from tessera.planner.costs import ELEMENT_BYTES
from tessera.planner.search import Candidate

# Bytes of training state per expert parameter: fp32 weight, gradient and Adam's two moments.
STATE_BYTES_PER_PARAM = 16


@dataclass(frozen=True)
class ExpertCosts:
    """The experts of a model, per MoE layer: how many, how many each token takes, their size and cost."""

    experts: int
    top_k: int
    layers: int  # MoE layers
    params: int  # one expert's parameters (in one layer)
    slot_s: float  # forward seconds of one token through one expert on a 1-TFLOP/s device
    row_bytes: int  # one token's hidden state, as the all-to-all sends it
    backward_ratio: float = 2.0

    @property
    def state_bytes(self) -> float:
        """Training state of one expert of every MoE layer (what holding one more expert costs a rank)."""
        return self.params * self.layers * STATE_BYTES_PER_PARAM


def expert_costs(model: nn.Module, precision: str = "fp32", mfu: float = 0.5) -> ExpertCosts | None:
    """The experts of ``model`` (built on the meta device: only shapes are read), or None for a dense model."""
    units = expert_modules(model)
    if not units:
        return None
    unit = units[0]
    params = sum(getattr(unit, name).numel() for name in unit.stacked_weights) // unit.num_experts
    config = getattr(model, "config", None)
    hidden = getattr(config, "dim", None) or config.hidden_size
    return ExpertCosts(
        experts=unit.num_experts,
        top_k=top_k_of(model),
        layers=len(units),
        params=params,
        slot_s=2 * params / (1e12 * mfu),
        row_bytes=hidden * ELEMENT_BYTES[precision],
    )


def place_experts(speeds: Sequence[float], experts: int, capacity: Sequence[int] | None = None) -> tuple[int, ...]:
    """How many experts each rank holds: at least one each, the rest one at a time to the rank that would
    finish its share soonest ((held + 1) / speed), never past ``capacity`` (experts its memory holds).

    This is the least possible slowest-rank time for loads proportional to the experts held."""
    if experts < len(speeds):
        raise ValueError(f"{experts} experts cannot give each of {len(speeds)} ranks one.")
    capacity = list(capacity) if capacity is not None else [experts] * len(speeds)
    if min(capacity) < 1 or sum(capacity) < experts:
        raise ValueError(f"the ranks' memory holds {list(capacity)} experts, short of one each and {experts} in all.")
    held = [1] * len(speeds)
    for _ in range(experts - len(speeds)):
        open_ranks = [r for r in range(len(speeds)) if held[r] < capacity[r]]
        best = min(open_ranks, key=lambda r: ((held[r] + 1) / speeds[r], r))
        held[best] += 1
    return tuple(held)


@dataclass(frozen=True)
class ExpertTime:
    """Predicted seconds of one step's expert work on an ep group: compute (the slowest rank's, forward and
    backward) and the all-to-all exchanges."""

    compute_s: float
    exchange_s: float

    @property
    def total_s(self) -> float:
        return self.compute_s + self.exchange_s


def expert_seconds(
    costs: ExpertCosts,
    seq_len: int,
    samples: Sequence[int],
    speeds: Sequence[float],
    shares: Sequence[int] | None,
    link: Link,
) -> ExpertTime:
    """A step's expert work on ranks taking ``samples`` each, of ``speeds`` TFLOP/s: with ``shares`` (expert
    parallelism) each rank runs the slots of its experts from every rank and exchanges rows (its experts'
    gradients stay on it); without, each rank runs its own tokens' experts and every expert's gradient is
    all-reduced over the ranks."""
    slots = [n * seq_len * costs.top_k for n in samples]  # each rank's tokens' slots, per layer
    passes = 1 + costs.backward_ratio
    if shares is None:
        compute = max(s * costs.slot_s / p for s, p in zip(slots, speeds))
        gradients = costs.experts * costs.params * costs.layers * 4  # fp32
        return ExpertTime(costs.layers * passes * compute, link.all_reduce_s(gradients, len(samples)))
    total = sum(slots)
    compute = max(total * held / costs.experts * costs.slot_s / p for held, p in zip(shares, speeds))
    # Rows each rank sends away (its slots for other ranks' experts) and receives (others' slots for its own).
    sent = [s * (1 - held / costs.experts) for s, held in zip(slots, shares)]
    received = [(total - s) * held / costs.experts for s, held in zip(slots, shares)]
    rows = max(max(sent), max(received))
    exchange = link.seconds(rows * costs.row_bytes) + link.latency_us * 1e-6 * (len(samples) - 1)
    return ExpertTime(costs.layers * passes * compute, costs.layers * 4 * exchange)


def with_experts(
    plan: Plan, dp: int, cluster: Cluster, costs: ExpertCosts, seq_len: int, global_batch: int, precision: str
) -> tuple[Plan, ExpertTime, ExpertTime] | None:
    """``plan`` (``dp`` data-parallel ranks) with those ranks as one ep group, experts placed by speed and
    memory (:func:`place_experts`), and the predicted expert work before and after; None where the plan's layout
    does not take it (pipeline stages, tp or sp, groups, replicas: the placement covers one flat
    data-parallel group) or there are fewer experts than ranks."""
    if dp < 2 or plan.pp > 1 or plan.tp > 1 or plan.sp > 1 or plan.groups is not None or plan.replicas is not None:
        return None
    if costs.experts < dp:
        return None
    devices = cluster.devices()
    types = [devices[plan.device_of(rank)][2] for rank in range(dp)]
    speeds = [t.peak(precision) or t.peak("fp32") or 1.0 for t in types]
    capacity = [max(1, int(t.memory_gib * 2**30 * USABLE_MEMORY // costs.state_bytes)) for t in types]
    shares = place_experts(speeds, costs.experts, capacity)
    even = len(set(shares)) == 1
    nodes = {devices[plan.device_of(rank)][0] for rank in range(dp)}
    link = cluster.worst_link(nodes)
    samples = split_batch(global_batch, plan.shares(dp))
    before = expert_seconds(costs, seq_len, samples, speeds, None, link)
    after = expert_seconds(costs, seq_len, samples, speeds, shares, link)
    placed = dataclasses.replace(plan, ep=dp, expert_shares=None if even else shares)
    return placed, before, after


def expert_candidate(
    candidate: Candidate, cluster: Cluster, costs: ExpertCosts, seq_len: int, global_batch: int, precision: str
) -> Candidate | None:
    """``candidate`` with its experts split over its data-parallel ranks and placed by speed
    (:func:`with_experts`), its estimate moved by the predicted change in expert work; None where that
    layout does not take it or is not predicted faster."""
    dp = getattr(candidate.layout, "dp", 0)  # (a mixed layout, of unlike replicas, has no one dp group)
    found = with_experts(candidate.plan, dp, cluster, costs, seq_len, global_batch, precision)
    if found is None:
        return None
    plan, before, after = found
    if after.total_s >= before.total_s:
        return None
    estimate = candidate.estimate
    step = estimate.step_s - before.total_s + after.total_s
    estimate = dataclasses.replace(
        estimate,
        step_s=step,
        tokens_per_s=global_batch * seq_len / step,
        breakdown={**estimate.breakdown, "experts": after.compute_s, "all_to_all": after.exchange_s},
    )
    shares = plan.expert_shares or (costs.experts // plan.ep,) * plan.ep
    note = (
        f"experts split over the {plan.ep} data-parallel ranks (Plan.ep), held {list(shares)} by device speed: "
        f"expert work {before.total_s * 1e3:.1f} -> {after.total_s * 1e3:.1f} ms a step (all-to-all "
        f"{after.exchange_s * 1e3:.1f} ms)"
    )
    return dataclasses.replace(candidate, plan=plan, estimate=estimate, notes=(*candidate.notes, note))
