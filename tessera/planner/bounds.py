"""A floor under the cost model's step time for a whole family of layouts, so the search can skip families
that cannot reach its top plans without judging each of their placements, splits and shares.

A family is (tp, pp, dp, micro-batch count). The floor holds for every placement, layer split, share vector
and option the search tries in it, because it keeps only terms each of those pays (the cost model's
``step_time``; :func:`step_floor` says which), each at its cheapest:

* compute: a replica's pipeline takes at least m × its slowest stage's forward and backward, and its slowest
  stage takes at least the replica's work over the replica's summed speed; over all replicas, whatever the
  shares, at least all the work (m calls per replica) over the whole cluster's speed;
* fill: one micro-batch of the biggest replica's goes through every stage, at best on the fastest unit;
  and the other m − 1 follow at the slowest stage's pace (at best the replica's summed speed). Under 1f1b
  with as many micro-batches as stages only 1/pp of the fill is sure: the slowest stage may be the first;
* sync: stage 0 finishes last, then all-reduces its gradients: at least one layer's (all of them with
  one stage), over the fastest link a data-parallel group of that size can have as its slowest, under the
  cheapest ZeRO stage.

``tests/test_planner.py`` checks the floor against every layout an exhaustive search judges.

Example:
    >>> floor = step_floor(cluster, units, costs, tp=8, pp=4, dp=16, microbatches=8, global_batch=512)
"""

from __future__ import annotations

from tessera.cluster.spec import Cluster, Link
from tessera.planner.costs import ModelCosts
from tessera.planner.layout import Layout, grad_sync_s
from tessera.planner.space import Unit, option_sets


def step_floor(
    cluster: Cluster, units: list[Unit], costs: ModelCosts, tp: int, pp: int, dp: int, microbatches: int,
    global_batch: int,
) -> float:  # fmt: skip
    """Seconds no layout of these degrees and micro-batch count can beat under the cost model."""
    m, n = microbatches, costs.n_layers
    per_pass = (1 + costs.backward_ratio) / tp  # forward and backward, the work split over tp devices

    def work(samples: float) -> float:  # one pass of the whole model over ``samples`` at 1 TFLOP/s
        return costs.stage_forward_s(0, n, samples, 1.0)

    speed = sum(u.spec.peak_tflops for u in units)
    fastest = max(u.spec.peak_tflops for u in units)
    compute = per_pass * (work(global_batch) + (dp * m - 1) * work(0)) / speed
    fill = per_pass * work(global_batch / (m * dp)) / fastest
    # The fill and then m − 1 more at the slowest stage's pace: a replica of summed speed V takes at least
    # work·(fill/fastest + (m − 1)/V) a micro-batch; that speed per replica, V/(V·fill/fastest + m − 1), is
    # concave in V, so summed over replicas it is largest with V spread evenly.
    even, fill_share = speed / dp, 1.0 if m != pp else 1.0 / pp
    paced = per_pass * (dp * work(0) + work(global_batch / m)) / (dp * even / (even * fill_share / fastest + m - 1))
    return max(compute, fill, paced) + _sync_floor(cluster, units, costs, tp, pp, dp, m)


def _sync_floor(cluster: Cluster, units: list[Unit], costs: ModelCosts, tp: int, pp: int, dp: int, m: int) -> float:
    return sync_floor(costs, tp, pp, dp, m, _row_links(cluster, units, dp))


def sync_floor(costs: ModelCosts, tp: int, pp: int, dp: int, m: int, links: list[Link]) -> float:
    """The cheapest gradient sync stage 0 can have (one layer; all with one stage) over any of ``links``: it
    follows the replicas' pipelines (stage 0 finishes last)."""
    if dp <= 1 or any(link.backend == "gloo" for link in links):  # gloo's ZeRO-1 trees: not bounded here
        return 0.0
    links = _unbeaten(links)
    stage = ((0, costs.n_layers),) if pp == 1 else ((0, 1),) + ((1, costs.n_layers),) * (pp - 1)
    schedule = "1f1b" if m >= pp else "gpipe"
    return max(
        0.0,
        min(
            grad_sync_s(Layout(pp, dp, tp, stage, m, schedule, o.zero, o.offload, "none", (), (link,) * pp), costs, 0)
            for o in option_sets(dp, pp, tp)
            for link in links
        ),
    )


def _unbeaten(links: list[Link]) -> list[Link]:
    """``links`` less those another beats on both bandwidth and latency: a sync only grows as a link's
    bandwidth falls or its latency rises (outside gloo, left out above), so the rest give the cheapest."""
    figures = {(link.bandwidth_gbs, link.latency_us): link for link in links}
    return [
        link
        for (bandwidth, latency), link in figures.items()
        if not any(b >= bandwidth and t <= latency and (b, t) != (bandwidth, latency) for b, t in figures)
    ]


def _row_links(cluster: Cluster, units: list[Unit], dp: int) -> list[Link]:
    """Every link that could be the slowest of a group of ``dp`` units (``Cluster.worst_link``): any, if one
    machine holds that many; else any but the intra-node one; and when no region holds that many, the
    inter-region link or a pair's own link slower than it."""
    per_host: dict[str, int] = {}
    per_region: dict[str, int] = {}
    for u in units:
        node = cluster.node(u.node)
        per_host[node.host] = per_host.get(node.host, 0) + 1
        per_region[node.region] = per_region.get(node.region, 0) + 1
    pairs, links = list(cluster.pair_links.values()), cluster.links
    if max(per_host.values()) >= dp:
        return [links["intra_node"], links["inter_node"], links["inter_region"], *pairs]
    if max(per_region.values()) >= dp:  # in one region or across: either base link, or a pair's
        return [links["inter_node"], links["inter_region"], *pairs]
    across = links["inter_region"]  # the group spans regions
    return [across, *(p for p in pairs if p.bandwidth_gbs < across.bandwidth_gbs)]


def pipelines_floor(
    costs: ModelCosts, kinds: list[tuple[int, list[float]]], transfers: list[tuple[float, float]], tp: int,
    microbatches: int, global_batch: int,
) -> float:  # fmt: skip
    """The slowest replica's pipeline, at least, over any shares of ``global_batch``: ``kinds`` the replica
    kinds as (count, each stage's unit peak) with ``transfers`` each kind's stage-to-stage seconds a
    micro-batch as (fixed, per sample) summed over its boundaries. Each replica's pipeline is at least affine
    in its samples n (compute: m·work/V; fill and pace: work/fastest + transfers + (m − 1)·work/V); over any
    shares, the slowest is at least the average of those lines weighted by 1/slope. Replicas may differ in
    depth (:mod:`~tessera.planner.mixed`)."""
    m, n = microbatches, costs.n_layers
    per_pass = (1 + costs.backward_ratio) / tp
    call, per_sample = costs.stage_forward_s(0, n, 0, 1.0), costs.stage_forward_s(0, n, 1, 1.0)
    per_sample -= call
    compute_lines, paced_lines = [], []
    for (count, peaks), (moving, moving_per_sample) in zip(kinds, transfers):
        speed, fastest, pp = sum(peaks), max(peaks), len(peaks)
        compute_lines += [(per_pass * m * call / speed, per_pass * per_sample / speed)] * count
        if m != pp:
            pace = 1 / fastest + (m - 1) / speed
            line = (per_pass * call * pace + 2 * moving, (per_pass * per_sample * pace + 2 * moving_per_sample) / m)
        else:  # 1f1b with m = pp: a 1/pp share of the fill, no transfers (see step_floor)
            pace = 1 / (pp * fastest) + (m - 1) / speed
            line = (per_pass * call * pace, per_pass * per_sample * pace / m)
        paced_lines += [line] * count
    return max(over_shares(lines, global_batch) for lines in (compute_lines, paced_lines))


def over_shares(lines: list[tuple[float, float]], samples: int) -> float:
    """min over shares (summing to ``samples``) of the largest fixed + slope × share: at least the average
    of the lines weighted by 1/slope (a relaxation: shares may be fractional, even negative)."""
    if any(slope <= 0 for _, slope in lines):
        return max(fixed for fixed, _ in lines)
    return (samples + sum(fixed / slope for fixed, slope in lines)) / sum(1 / slope for _, slope in lines)
