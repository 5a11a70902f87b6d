"""Measurements made planner inputs: the planner plans from what a live profile measured instead of the
cluster file's declared figures.

:func:`measured_cluster` gives each node a device type whose speed is the node's measured block time
relative to the fastest node's, whose memory speed is the measured optimizer speed, and links with the
measured bandwidth and latency; :func:`measured_costs` gives per-part costs from the fastest node's own
profiles (their median); the overheads of FSDP units and of tensor parallelism come from the pairs timed.

Example:
    >>> live = LiveProfile.load("cluster-profile.json")
    >>> analytic = ModelCosts.from_model(model, seq_len=64)
    >>> plan_for(measured_cluster(cluster, live), model, 32, costs=measured_costs(live, analytic))
"""

from __future__ import annotations

import copy
import statistics
from dataclasses import replace

from tessera.cluster.catalog import DeviceType
from tessera.cluster.spec import Cluster, Link
from tessera.errors import PlanError
from tessera.planner.costs import ModelCosts, fit_line
from tessera.planner.live.records import (
    LinkMeasurement,
    LiveProfile,
    RankMeasurement,
)
from tessera.planner.profile import Profile


def _check_matches(cluster: Cluster, live: LiveProfile) -> None:
    devices = cluster.devices()
    for r in live.ranks:
        if r.device >= len(devices) or devices[r.device][0] != r.node:
            raise PlanError(
                f"the live profile's rank {r.rank} played device {r.device} on node {r.node!r}, which this cluster "
                "file does not have there: profile again with this cluster file (`tessera cluster profile`)."
            )
    missing = sorted({n.name for n in cluster.nodes} - {r.node for r in live.ranks})
    if missing:
        raise PlanError(
            f"the live profile measured no device of node(s) {', '.join(missing)}: profile with one rank per "
            "device of the cluster file."
        )


def _by_node(live: LiveProfile) -> dict[str, list[RankMeasurement]]:
    out: dict[str, list[RankMeasurement]] = {}
    for r in live.ranks:
        out.setdefault(r.node, []).append(r)
    return out


def fastest_node(live: LiveProfile) -> str:
    """The node whose ranks' median block time is the smallest: the reference (speed 1.0). A node's
    median, not the fastest single rank: picking the smallest of several noisy timings of alike
    devices would make every cost optimistic."""
    speeds = relative_speeds(live)
    return max(speeds, key=lambda node: speeds[node])


def relative_speeds(live: LiveProfile) -> dict[str, float]:
    """Each node's speed relative to the fastest node: the ratio of their ranks' median block times."""
    medians = {node: statistics.median(r.block_s() for r in ranks) for node, ranks in _by_node(live).items()}
    fastest = min(medians.values())
    return {node: fastest / t for node, t in medians.items()}


def _median_profile(ranks: list[RankMeasurement]) -> Profile:
    """One profile whose every time is the median over ``ranks`` (alike devices of one node)."""
    merged = copy.deepcopy(ranks[0].profile)
    for name, part in merged.layers.items():
        for times in ("forward_s", "backward_s"):
            per_size = getattr(part, times)
            for b in per_size:
                per_size[b] = statistics.median(getattr(r.profile.layers[name], times)[b] for r in ranks)
    return merged


def measured_cluster(cluster: Cluster, live: LiveProfile) -> Cluster:
    """``cluster`` with every node's speed, memory speed and every measured link replaced by measurements.

    A node's device type becomes ``<node> (measured)``: its peak is the node's relative speed
    (the fastest node 1.0) for every dtype the declared type has, its memory speed the median
    measured optimizer speed (and its host's, for offload: the same CPU when the device is one),
    its memory the declared capacity."""
    _check_matches(cluster, live)
    speeds = relative_speeds(live)
    types: dict[str, DeviceType] = {}
    nodes = []
    for node in cluster.nodes:
        declared = cluster.device_type(node.name)
        mine = [r for r in live.ranks if r.node == node.name]
        optimizer = statistics.median(r.optimizer_gbs for r in mine)
        # A CPU rank is its own host (offload would move nothing); a GPU rank's host was timed apart.
        host = statistics.median(r.host_optimizer_gbs or r.optimizer_gbs for r in mine)
        name = f"{node.name} (measured)"
        peaks = {dtype: speeds[node.name] for dtype in declared.peak_tflops}
        overlap = statistics.median(r.comm_overlap for r in mine)
        types[name] = DeviceType(name, peaks, declared.memory_gib, optimizer, host, overlap)
        nodes.append(replace(node, device_type=name))
    # Every link runs the backend the profile ran, measured or not.
    links = {name: replace(link, backend=live.backend) for name, link in cluster.links.items()}
    pairs = {pair: replace(link, backend=live.backend) for pair, link in cluster.pair_links.items()}
    own = [k for k in live.links if k.nodes[0] == k.nodes[1]]
    if own:
        links["intra_node"] = _measured_link(min(own, key=lambda k: k.bandwidth_gbs), live)
    for k in live.links:
        if k.nodes[0] != k.nodes[1]:
            pairs[frozenset(k.nodes)] = _measured_link(k, live)
    return Cluster(tuple(nodes), types, links, pairs)


def _measured_link(k: LinkMeasurement, live: LiveProfile) -> Link:
    """The link a measurement describes: its send bandwidth, latency and burst.

    A burst counts between nodes only, where a shaper may keep a bucket. Inside a node nothing shapes
    the link, yet on CPU quotas a lone push after idling runs up to 3× the back-to-back rate (it fits
    in one quota period's budget), which a step of many collectives does not get back.

    Collectives get the send bandwidth. Session 13 bounded it by the pair's own all-reduce (each member
    copies and reduces, a throttled one slowly), but on the testbed rings of four ranks crossed the slow
    pair at its send rate (48 Mbit/s) where the pair's two-rank all-reduce made 44, and the bound put
    every layout over that pair 7-11 % slow (benchmarks/gloo_collectives.py, docs/benchmarks.md)."""
    burst = k.burst_bytes if k.nodes[0] != k.nodes[1] else 0.0
    return Link(k.bandwidth_gbs, k.latency_us, live.backend, burst)


def measured_costs(live: LiveProfile, analytic: ModelCosts) -> ModelCosts:
    """Per-part costs from the fastest node's ranks (the median of their profiles), at speed 1.0 (what
    :func:`measured_cluster` calls it).

    ``analytic`` (:meth:`ModelCosts.from_model` of the same model) gives what timing cannot: the
    head count tensor parallelism must divide, the parameters a tied head shares and the loss's bytes."""
    if live.seq_len != analytic.seq_len:
        raise PlanError(
            f"the live profile was measured at sequence length {live.seq_len}, the model is planned at "
            f"{analytic.seq_len}: profile again with this config."
        )
    node = fastest_node(live)
    ranks = _by_node(live)[node]
    costs = ModelCosts.from_profile(_median_profile(ranks), 1.0, analytic.hidden, live.precision)
    # A line through every measured size: the search takes times to be affine in the micro-batch.
    points = dict(tensor_parallel_overhead(live, costs))
    tp_call, tp_sample = fit_line(points) if points else (0.0, 0.0)
    return replace(
        costs,
        fsdp_unit_s=fsdp_unit_overhead(live, costs, statistics.median(r.fsdp_unit_s for r in ranks)),
        tp_block_s=tp_call,
        tp_sample_s=tp_sample,
        tp_replicated_activations=tensor_parallel_replicated(live, analytic),
        name=analytic.name,
        heads=analytic.heads,
        shared_params=analytic.shared_params,
        loss_saved_bytes=analytic.loss_saved_bytes,  # what cross-entropy allocates does not depend on the device
        loss_grad_bytes=analytic.loss_grad_bytes,
        source=f"live profile ({live.where}; fastest: node {node}, median of its {len(ranks)} rank(s))",
    )


def _pair_link(live: LiveProfile, a: str, b: str) -> Link:
    """The measured link between nodes ``a`` and ``b``, where the profile timed FSDP across them."""
    timed = [k for k in live.links if set(k.nodes) == {a, b}]
    if not timed:
        raise PlanError(
            f"the live profile timed FSDP across nodes {a!r} and {b!r} but not the link between them: profile "
            "again with `tessera cluster profile`."
        )
    return _measured_link(timed[0], live)


def _node_link(live: LiveProfile, node: str, timed: str) -> Link:
    """The measured link inside ``node``, where the profile timed ``timed`` on a pair of its ranks."""
    own = [k for k in live.links if k.nodes == (node, node)]
    if not own:
        raise PlanError(
            f"the live profile timed {timed} on node {node!r} but not the link inside it: profile again with "
            "`tessera cluster profile`."
        )
    return _measured_link(own[0], live)


def fsdp_unit_overhead(live: LiveProfile, costs: ModelCosts, alone_s: float) -> float:
    """Seconds FSDP adds per unit (each block, and the root) and pass at the fastest node's speed, beyond
    the transfers both predictors count: from the measured pair, (sharded − plain − its gathers and
    reduce-scatters priced by the node's link, or by the link between the pair's nodes when no node had
    two ranks) / (2 passes × units). ``alone_s`` (the one-rank measurement) where the profile has no pair."""
    m = live.fsdp_pair
    if m is None:
        return alone_s
    link = _node_link(live, m.node, "FSDP") if not m.across else _pair_link(live, m.node, m.across)
    n, units = len(m.ranks), costs.n_layers + 1
    # fully_shard's default reshards after the forward: a gather per unit in each pass, one reduce-scatter
    ring_steps = 2 * (n - 1) + link.reduce_scatter_steps(n)
    comm = ring_steps * (costs.stage_params(0, costs.n_layers) * 4 / n / (link.bandwidth_gbs * 1e9))
    comm += units * ring_steps * link.latency_us * 1e-6
    speed = relative_speeds(live)[m.node]  # the node's seconds → the fastest node's
    return speed * max(m.sharded_s - m.plain_s - comm, 0.0) / (2 * units)


def tensor_parallel_overhead(live: LiveProfile, costs: ModelCosts) -> tuple[tuple[int, float], ...]:
    """((micro-batch size, seconds), ...): what a tensor-parallel block costs per pass at each measured
    size, at the fastest node's speed, beyond what both predictors already count: its 1/tp share of
    the compute and two ring all-reduces of the hidden states priced by the node's measured link.

    From :class:`TensorParallelMeasurement`: (sharded − plain / tp − the link's all-reduces) /
    (2 passes × blocks). It holds DTensor's dispatch, the smaller matmuls' lower speed and the waits
    at blocking all-reduces (on the testbed, for a partner throttled by its CPU quota), which an idle
    ping-pong does not see. :func:`measured_costs` fits a line through these points (1 to 32 samples:
    a line through 2 and 8 alone put tp2 at 32 samples 55% slow). Empty when the profile has no
    tensor-parallel measurement."""
    m = live.tensor_parallel
    if m is None:
        return ()
    link, tp, blocks = _node_link(live, m.node, "tensor parallelism"), len(m.ranks), costs.n_layers
    speed = relative_speeds(live)[m.node]  # the node's seconds → the fastest node's
    points = []
    for b, plain in sorted(m.plain_s.items()):
        comm = 2 * 2 * blocks * link.all_reduce_s(costs.boundary_bytes(b), tp)
        points.append((b, speed * max(m.sharded_s[b] - plain / tp - comm, 0.0) / (2 * blocks)))
    return tuple(points)


def tensor_parallel_replicated(live: LiveProfile, analytic: ModelCosts) -> float:
    """The share of saved activations every tp rank keeps whole, from the measured pair: a sharded
    step's transient peak over the plain one's is ``r + (1 − r) / tp``. Measured here 0.70 at tp 2
    (r = 0.39), not the 0.5 that splitting everything would give. Without a measurement (or one
    outside [1/tp, 1]), ``analytic``'s."""
    m = live.tensor_parallel
    if m is None or not m.plain_peak_bytes or not m.sharded_peak_bytes:
        return analytic.tp_replicated_activations
    tp = len(m.ranks)
    share = m.sharded_peak_bytes / m.plain_peak_bytes
    if not 1 / tp <= share <= 1:
        return analytic.tp_replicated_activations
    return (share - 1 / tp) / (1 - 1 / tp)
