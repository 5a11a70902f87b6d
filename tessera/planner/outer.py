"""The outer level: one group of ranks per region (``Plan.groups``), synchronised across the
inter-region link every step, with DiLoCo, or with Streaming DiLoCo.

When a cluster's regions are alike (the same node types and counts, in the same order), each
region's ranks become a group laid out by the ordinary search on that region alone and its share
of the global batch. When they are not (:func:`unlike_region_candidates`), each region is searched
on its own, its share of the batch set by its speed, and the groups run as fault-tolerant jobs,
each with its own layout (``Plan.groups.layouts``), meeting in canonical slots. What the groups
send each other decides the outer sync:

- ``every_step`` (hierarchical): every step's gradients cross, a slice per rank;
- ``diloco``: the fp32 weights cross once every H steps; H is the smallest at which that sync
  costs at most :data:`OUTER_BUDGET` (10 %) of the H inner steps;
- ``streaming``: the weights in F fragments, one crossing every H/F steps while the next
  ``delay`` step computes; H is the smallest at which what the overlap does not hide costs at
  most the same budget, and the link carries a fragment at a time (peak: 1/F of DiLoCo's).

A sync's transfer is a ring all-reduce over the groups on the inter-region link, each group's
bytes spread over its nodes (each node sends its ranks' slices on its own path). Every-step sync
is the choice when it costs at most the budget of a step (training stays synchronous). Otherwise
the option with the smallest H wins (the fewest local steps between syncs), streaming on a tie
for its lower peak. :func:`outer_choice` says why in words.

Example:
    >>> options = outer_options(inner_step_s=0.5, params=8e9, grad_bytes=4, groups=3, seconds=link_time)
    >>> choose(options).sync, choose(options).inner_steps
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, replace

from tessera.cluster.spec import Cluster, Node
from tessera.errors import PlanError
from tessera.plan import Plan
from tessera.plan.groups import Groups
from tessera.planner.costs import ModelCosts
from tessera.planner.layout import ranks_of
from tessera.planner.search import Candidate, search

OUTER_BUDGET = 0.1  # the share of the inner steps' time a sync may cost
STREAMING_FRAGMENTS = (2, 4, 8)
STREAMING_DELAY = 1
MAX_H = 10_000
SHARE_ROUNDS = 3  # regions not alike: batch shares set by speed, re-searched while the slowest gets faster


@dataclass(frozen=True)
class OuterOption:
    """One way to synchronise the groups, and what it costs per step (averaged over its H steps)."""

    sync: str
    inner_steps: int
    fragments: int
    delay: int
    step_s: float  # inner step plus the sync's exposed share
    exposed_s: float  # seconds per step the sync adds
    sync_s: float  # one whole sync's transfer (all fragments)
    bytes_per_step: float  # across regions, every group's, averaged over steps
    peak_bytes: float  # the most that crosses at once (a sync, or a fragment)

    def groups(self, count: int) -> Groups:
        if self.sync == "every_step":
            return Groups(count=count, sync="every_step")
        return Groups(
            count=count, sync=self.sync, inner_steps=self.inner_steps, fragments=self.fragments, delay=self.delay
        )

    def describe(self) -> str:
        if self.sync == "every_step":
            return "every step (hierarchical)"
        if self.sync == "diloco":
            return f"DiLoCo H={self.inner_steps}"
        return f"streaming H={self.inner_steps} F={self.fragments} delay {self.delay}"


def regions_of(cluster: Cluster) -> list[list[Node]]:
    """The nodes of each region, regions in the order the cluster file first names them."""
    regions: dict[str, list[Node]] = {}
    for node in cluster.nodes:
        regions.setdefault(node.region, []).append(node)
    return list(regions.values())


def region_cluster(cluster: Cluster, nodes: list[Node]) -> Cluster:
    """The cluster of ``nodes`` alone (one region), with the links between them."""
    names = {n.name for n in nodes}
    pairs = {pair: link for pair, link in cluster.pair_links.items() if pair <= names}
    return Cluster(tuple(nodes), cluster.device_types, cluster.links, pairs)


def alike_regions(cluster: Cluster) -> list[list[Node]] | None:
    """The nodes of each region, when there are several and all are made alike; else None."""
    regions = regions_of(cluster)
    if len(regions) < 2:
        return None
    make_ups = {tuple((n.device_type, n.count) for n in nodes) for nodes in regions}
    return regions if len(make_ups) == 1 else None


def sync_seconds(cluster: Cluster, regions: list[list[Node]]) -> Callable[[float], float]:
    """Seconds to average ``n_bytes`` (one group's) across the groups: a ring over the regions on their
    slowest link, each group's bytes spread over its nodes (the region with the fewest paces it)."""
    link = min(
        (cluster.link(a[0].name, b[0].name) for i, a in enumerate(regions) for b in regions[i + 1 :]),
        key=lambda lk: lk.bandwidth_gbs,
    )
    nodes = min(len(r) for r in regions)
    return lambda n_bytes: link.all_reduce_s(n_bytes / nodes, len(regions))


def outer_options(
    inner_step_s: float, params: int, grad_bytes: int, groups: int, seconds: Callable[[float], float]
) -> list[OuterOption]:
    """Every-step, DiLoCo and Streaming DiLoCo (each fragment count tried) for groups whose inner step takes
    ``inner_step_s``; ``seconds(n)``: one sync of ``n`` bytes a group across the regions."""
    across = 2 * (groups - 1)  # a ring all-reduce: every group sends 2(G - 1)/G of its bytes, G groups
    budget = OUTER_BUDGET * inner_step_s
    every = seconds(params * grad_bytes)
    options = [
        OuterOption(
            "every_step",
            1,
            1,
            0,
            inner_step_s + every,
            every,
            every,
            across * params * grad_bytes,
            across * params * grad_bytes,
        )  # fmt: skip
    ]
    weights = params * 4  # the outer gradient is fp32
    whole = seconds(weights)
    h = min(MAX_H, max(1, math.ceil(whole / budget)))
    options.append(OuterOption("diloco", h, 1, 0, inner_step_s + whole / h, whole / h, whole, across * weights / h,
                               across * weights))  # fmt: skip
    for fragments in STREAMING_FRAGMENTS:
        part = seconds(weights / fragments)
        hidden = STREAMING_DELAY * inner_step_s
        exposed = max(0.0, part - hidden)  # per fragment, beyond the delay's steps
        # a fragment lands before the next leaves (H/F > delay), the link keeps up (a fragment's transfer
        # fits in H/F steps), and the exposed share meets the budget
        turn = max(STREAMING_DELAY + 1, math.ceil(part / inner_step_s), math.ceil(exposed / budget))
        h = min(MAX_H, turn * fragments)
        options.append(
            OuterOption("streaming", h, fragments, STREAMING_DELAY, inner_step_s + exposed * fragments / h,
                        exposed * fragments / h, part * fragments, across * weights / h, across * weights / fragments)
        )  # fmt: skip
    return options


def choose(options: list[OuterOption]) -> OuterOption:
    """Every-step when its sync costs at most the budget; else the smallest H (streaming on a tie)."""
    every = next((o for o in options if o.sync == "every_step"), None)
    if every is not None and every.exposed_s <= OUTER_BUDGET * (every.step_s - every.exposed_s):
        return every
    rest = [o for o in options if o is not every]
    return min(rest, key=lambda o: (o.inner_steps, o.peak_bytes, o.step_s))


def runnable(options: list[OuterOption], plan: Plan, n_layers: int) -> list[OuterOption]:
    """The options ``plan`` (one group's inner layout) can run: streaming fragments that divide the layers
    (every stage's: each stage syncs its own), and with pipeline stages no every-step sync."""
    if plan.pp == 1:
        return [o for o in options if n_layers % o.fragments == 0]
    layers = [end - first for first, end in plan.pipeline.stage_ranges(n_layers, plan.pp)]
    return [o for o in options if o.sync != "every_step" and all(n % o.fragments == 0 for n in layers)]


def outer_choice(options: list[OuterOption]) -> str:
    """Why :func:`choose` picked what it picked, in one sentence with the figures."""
    every, best = options[0], choose(options)
    inner = every.step_s - every.exposed_s
    if every.sync != "every_step":  # a pipeline inside the groups: only weight syncs run
        return (
            f"outer level: {best.describe()} syncs each stage's weights ({best.sync_s:.3g} s a sync) for "
            f"{best.exposed_s:.3g} s of a {inner:.3g} s inner step, {_size(best.bytes_per_step)} a step across, "
            f"{_size(best.peak_bytes)} at once — the smallest H within {OUTER_BUDGET:.0%} of the inner steps "
            f"(every-step sync does not run with pipelines inside the groups yet). {LOSS_COST}"
        )
    if best is every:
        return (
            f"outer level: every-step sync across regions costs {every.exposed_s:.3g} s of a {every.step_s:.3g} s "
            f"step (at most {OUTER_BUDGET:.0%}): training stays synchronous"
        )
    return (
        f"outer level: every-step sync would add {every.exposed_s:.3g} s to a {inner:.3g} s inner step "
        f"({_size(every.bytes_per_step)} across regions a step); {best.describe()} syncs the weights "
        f"({best.sync_s:.3g} s a sync) for {best.exposed_s:.3g} s a step, {_size(best.bytes_per_step)} a "
        f"step across, {_size(best.peak_bytes)} at once — the smallest H within {OUTER_BUDGET:.0%} of "
        f"the inner steps. {LOSS_COST}"
    )


# What the outer level costs in loss, as measured (docs/benchmarks.md, benchmarks/cross_region.py): tokens/s
# alone ranks a DiLoCo-style plan too well, so its note says what it gives up.
LOSS_COST = (
    "Its step time is not the whole cost: DiLoCo trains differently from synchronous SGD. Measured on the "
    "testbed (the demo Llama, 0.85 M parameters, H = 50, 2,000 steps), its held-out loss ended 8.6 % above "
    "synchronous training from scratch and 1.1 % above it after a synchronous first quarter (a warm start): "
    "compare plans by the time to a target loss, not by tokens/s."
)


def _size(n_bytes: float) -> str:
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n_bytes >= scale:
            return f"{n_bytes / scale:.3g} {unit}"
    return f"{n_bytes:.0f} B"


def outer_candidates(cluster: Cluster, costs: ModelCosts, global_batch: int, top: int) -> list[Candidate]:
    """The best inner plan of one region (mixed replicas aside: groups do not take them yet),
    run in every region as a group, with the outer sync :func:`choose` picks. Empty unless the regions
    are alike and the batch splits evenly over them."""
    regions = alike_regions(cluster)
    if regions is None or global_batch % len(regions):
        return []
    count = len(regions)
    names = [{n.name for n in nodes} for nodes in regions]
    sub = region_cluster(cluster, regions[0])
    try:
        inner = search(sub, costs, global_batch // count, top=1, mixed=False)  # groups take no mixed replicas yet
    except PlanError:  # one region cannot hold the model, or its batch is too small
        return []
    devices = cluster.devices()
    kept = [[d for d, (node, _, _) in enumerate(devices) if node in region] for region in names]
    params = costs.stage_params(0, costs.n_layers)
    seconds = sync_seconds(cluster, regions)
    out = []
    for candidate in inner:
        options = runnable(
            outer_options(candidate.estimate.step_s, params, 4, count, seconds), candidate.plan, costs.n_layers
        )
        best = choose(options)
        size = len(candidate.plan.placement) if candidate.plan.placement is not None else sub.world_size
        placement = tuple(kept[g][candidate.plan.device_of(i)] for g in range(count) for i in range(size))
        plan = replace(
            candidate.plan,
            groups=best.groups(count),
            placement=placement,
            rank_devices=tuple(f"{devices[d][0]}:{devices[d][1]}:{devices[d][2].name}" for d in placement),
        )
        estimate = replace(
            candidate.estimate,
            step_s=best.step_s,
            tokens_per_s=global_batch * costs.seq_len / best.step_s,
            bottleneck=f"{best.describe()} across {count} regions: {best.exposed_s:.3g} s a step",
            breakdown={**candidate.estimate.breakdown, "outer_sync_s": best.exposed_s},
        )
        label = f"{candidate.placement}; one group per region ({count})"
        out.append(Candidate(plan, candidate.layout, estimate, label, (*candidate.notes, outer_choice(options))))
    return out


def _region_plans(subs: list[Cluster], costs: ModelCosts, batches: list[int]) -> list[Candidate] | None:
    """Each region's fastest plan for its batch that groups which differ can run (no replicas of different
    depth, no sequence parallelism); None when a region has none."""
    found = []
    for sub, batch in zip(subs, batches):
        try:
            ranked = search(sub, costs, batch, top=1, mixed=False)  # groups take no mixed replicas yet
        except PlanError:
            return None
        found.append(ranked[0])
    return found


def _speed_shares(batches: list[int], plans: list[Candidate], global_batch: int) -> list[int]:
    """Samples per region in proportion to what each region's plan takes a second, summing to the batch."""
    rates = [b / c.estimate.step_s for b, c in zip(batches, plans)]
    shares = [max(1, math.floor(global_batch * r / sum(rates))) for r in rates]
    while sum(shares) > global_batch:
        shares[shares.index(max(shares))] -= 1
    for i in sorted(range(len(rates)), key=lambda i: -rates[i])[: global_batch - sum(shares)]:
        shares[i] += 1
    return shares


def unlike_region_candidates(cluster: Cluster, costs: ModelCosts, global_batch: int) -> list[Candidate]:
    """One fault-tolerant group per region when the regions are not alike: each region searched alone for
    its share of the batch (set by speed: an even split first, then shares in proportion to what each
    region's plan takes a second, for up to SHARE_ROUNDS rounds while the slowest region's step shrinks),
    each group laid out its own way, the outer sync :func:`choose` picks (DiLoCo or Streaming DiLoCo:
    fault-tolerant groups meet at quorums, not every step; streaming only when no group has stages). Empty when the
    regions are alike (:func:`outer_candidates`), fewer than two, or one cannot hold the model."""
    regions = regions_of(cluster)
    if len(regions) < 2 or alike_regions(cluster) is not None or global_batch < len(regions):
        return []
    count, subs = len(regions), [region_cluster(cluster, nodes) for nodes in regions]
    batches = [global_batch // count + (g < global_batch % count) for g in range(count)]
    plans = _region_plans(subs, costs, batches)
    if plans is None:
        return []
    for _ in range(SHARE_ROUNDS):  # a step is not linear in the batch (whole micro-batches, pipelines): again
        shares = _speed_shares(batches, plans, global_batch)
        again = _region_plans(subs, costs, shares) if shares != batches else None
        if again is None or max(c.estimate.step_s for c in again) >= max(c.estimate.step_s for c in plans):
            break
        batches, plans = shares, again
    inner_s = max(c.estimate.step_s for c in plans)  # the groups meet every H steps: the slowest paces them
    params = costs.stage_params(0, costs.n_layers)
    options = outer_options(inner_s, params, 4, count, sync_seconds(cluster, regions))
    # fault-tolerant groups meet at quorums, not every step; Streaming DiLoCo's fragments are runs of each
    # stage's own layers, which groups staged differently do not share: with stages, DiLoCo only
    staged = any(c.plan.pp > 1 for c in plans)
    options = [o for o in options if o.sync == "diloco" or (o.sync == "streaming" and not staged)]
    for c in plans:
        options = runnable(options, c.plan, costs.n_layers)
    best = choose(options)
    layouts = []
    for c in plans:
        p = c.plan
        layout = {"zero": p.zero, "tp": p.tp, "pp": p.pp, "offload": p.offload, "recompute": p.recompute,
                  "dp_shares": p.dp_shares, "placement": p.placement, "microbatches": p.pipeline.microbatches,
                  "stages": p.pipeline.stages, "schedule": p.pipeline.schedule}  # fmt: skip
        layouts.append({k: v for k, v in layout.items() if v is not None})
    groups = Groups(
        count=count, sync=best.sync, inner_steps=best.inner_steps, fragments=best.fragments, delay=best.delay,
        fault_tolerant=True, sizes=tuple(ranks_of(c.plan, sub) for c, sub in zip(plans, subs)),
        shares=tuple(batches), layouts=tuple(layouts),
    )  # fmt: skip
    # every rank's device, group after group: each group's machines launch their block of its ranks (--node-rank)
    devices = [d for c in plans for d in c.plan.rank_devices or ()]
    plan = Plan(precision=plans[0].plan.precision, groups=groups, rank_devices=tuple(devices) or None)
    step = inner_s + best.exposed_s
    slowest = max(plans, key=lambda c: c.estimate.step_s)
    estimate = replace(
        slowest.estimate,
        step_s=step,
        tokens_per_s=global_batch * costs.seq_len / step,
        memory=tuple(m for c in plans for m in c.estimate.memory),  # every region's devices
        bottleneck=f"{best.describe()} across {count} regions: {best.exposed_s:.3g} s a step",
        breakdown={**slowest.estimate.breakdown, "outer_sync_s": best.exposed_s},
    )
    described = "; ".join(
        f"{len(r)} nodes: dp{c.plan.dp} tp{c.plan.tp} pp{c.plan.pp} ZeRO-{c.plan.zero}, {b} samples, "
        f"{c.estimate.step_s:.3g} s"
        for r, c, b in zip(regions, plans, batches)
    )  # fmt: skip
    note = (
        f"regions not alike: each its own plan ({described}), run as fault-tolerant groups (one job per region, "
        f"meeting through a Lighthouse); outer level: {best.describe()} syncs the weights ({best.sync_s:.3g} s a "
        f"sync) for {best.exposed_s:.3g} s of a {inner_s:.3g} s inner step, {_size(best.bytes_per_step)} a step "
        f"across, {_size(best.peak_bytes)} at once — the smallest H within {OUTER_BUDGET:.0%} of the inner steps "
        f"(fault-tolerant groups do not sync every step{'; streaming needs groups without stages' if staged else ''}). "
        f"{LOSS_COST}"
    )
    label = f"one group per region ({count}), each laid out its own way"
    return [Candidate(plan, slowest.layout, estimate, label, (*slowest.notes, note))]  # the picture: its timeline
