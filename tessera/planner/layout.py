"""A Plan placed on a cluster, in the compact form the cost model, simulator and search read.

A :class:`Layout` is a Plan's sizes plus, for every data-parallel replica, the device at each of
its pipeline stages. Replicas that are alike (same devices, same micro-batch size) are one
:class:`ReplicaSpec` with a count, so a 4,096-device layout of six device types is a handful of
entries, not 4,096. :func:`op_times` turns a replica into per-stage forward, backward and
transfer seconds: the inputs both the closed-form cost model and the simulator compose.

Example:
    >>> layout = layout_from_plan(plan, cluster, global_batch=64)
    >>> op_times(layout, costs, layout.replicas[0])
"""

from __future__ import annotations

import functools
import math
from collections import Counter
from dataclasses import dataclass, field

from tessera.cluster.spec import USABLE_MEMORY, Cluster, Link
from tessera.errors import PlanError
from tessera.parallel.data_parallel import BUCKET_BYTES
from tessera.plan import Plan, RankCoords
from tessera.planner.costs import ModelCosts

# Host ↔ device copies for offload (PCIe 4.0 x16, one direction) and the host's own memory bandwidth.
HOST_LINK = Link(25.0, 10.0)
HOST_BANDWIDTH_GBS = 50.0


@dataclass(frozen=True)
class UnitSpec:
    """One tensor-parallel group (``tp`` devices of one stage of one replica), by its slowest member."""

    device: str  # device type name
    peak_tflops: float
    memory_bytes: float  # the smallest member's usable memory
    bandwidth_gbs: float
    tp_link: Link  # slowest link inside the group (unused when tp == 1)
    host_bandwidth_gbs: float = 0.0  # memory speed of the host an offloaded optimizer steps on (0: HOST_BANDWIDTH)
    comm_overlap: float = 1.0  # the least of its members' DeviceType.comm_overlap


@dataclass(frozen=True)
class ReplicaSpec:
    """``count`` alike data-parallel replicas: their unit per stage and micro-batch size."""

    count: int
    units: tuple[UnitSpec, ...]
    p2p: tuple[Link, ...]  # link from stage s to s + 1
    micro_batch: int  # samples per micro-batch (a replica's share is micro_batch × microbatches)


@dataclass(frozen=True)
class Layout:
    """A Plan's sizes and choices with the devices it runs on; see the module docstring."""

    pp: int
    dp: int
    tp: int
    stages: tuple[tuple[int, int], ...]
    microbatches: int
    schedule: str
    zero: int
    offload: bool
    recompute: str
    replicas: tuple[ReplicaSpec, ...]
    dp_links: tuple[Link, ...]  # per stage: slowest link among that stage's data-parallel group
    # Where each replica's stages run (node names, one replica per entry) and the links between those
    # nodes: known for a layout built from a Plan, so the simulator sees which transfers share a link.
    nodes: tuple[tuple[str, ...], ...] = field(default=(), compare=False)
    node_links: tuple[tuple[str, str, Link], ...] = field(default=(), compare=False)
    # Per stage, the node of each data-parallel rank in group order (known to the search too, which folds
    # alike replicas): where ZeRO-1's broadcasts from each owner go (see owner_broadcasts_s).
    dp_groups: tuple[tuple[str, ...], ...] = field(default=(), compare=False)
    # Gradients are plain ``.grad`` tensors that zero_grad frees between steps (the replicas engine), not a
    # wrapper's buckets kept across steps (DDP): a step's first forward runs without them (device_memory).
    grads_freed: bool = field(default=False, compare=False)

    @property
    def global_batch(self) -> int:
        return sum(r.count * r.micro_batch for r in self.replicas) * self.microbatches

    def link_between(self, a: str, b: str) -> Link:
        """The link between nodes ``a`` and ``b`` of :attr:`nodes` (the same node: its intra-node link)."""
        for x, y, link in self.node_links:
            if {x, y} == {a, b}:
                return link
        raise KeyError(f"no link between {a} and {b} in this layout")


@dataclass(frozen=True)
class SyncGroup:
    """One all-reduce of the replicas' gradient sync: the ranks that hold the same gradient pieces (one per
    replica, as ``(replica, stage, tp index)``), how many parameters they average, and the slowest link
    among their nodes (a group of replicas that never crosses a slow link never pays for it)."""

    holders: tuple[tuple[int, int, int], ...]
    ranks: tuple[int, ...]  # the holders' plan ranks, sorted: the runtime handles its groups in this order
    params: float
    link: Link
    nodes: frozenset[str]


@dataclass(frozen=True)
class MixedLayout:
    """Replicas of several depths: one one-replica Layout per replica (pp = its depth, dp = R), and the
    groups their gradients are averaged in (:func:`sync_groups`)."""

    parts: tuple[Layout, ...]
    sync_groups: tuple[SyncGroup, ...]
    devices: tuple[tuple[int, ...], ...] = field(default=())  # each replica's cluster devices, stage order

    @property
    def microbatches(self) -> int:
        return self.parts[0].microbatches

    @property
    def global_batch(self) -> int:
        return sum(p.replicas[0].micro_batch for p in self.parts) * self.microbatches


@dataclass(frozen=True)
class OpTimes:
    """Seconds of one micro-batch's forward and backward on each stage, and of each stage-to-stage transfer."""

    forward: tuple[float, ...]
    backward: tuple[float, ...]
    transfer: tuple[float, ...]  # stage s → s + 1 (the same back for the gradient)
    latency: tuple[float, ...] = ()  # the part of each transfer that is the link's latency (none: 0)

    def moving_s(self, boundary: int) -> float:
        """The part of a transfer over stage boundary ``boundary`` that occupies the link: all but its latency."""
        return self.transfer[boundary] - (self.latency[boundary] if self.latency else 0.0)


def recomputes(mode: str, index: int) -> bool:
    """Whether a stage's ``index``-th block reruns its forward in the backward under ``Plan.recompute=mode``
    (as :func:`~tessera.parallel.recompute.apply_recompute` picks them: ``"selective"`` every second block
    from the first). ``"ops"`` reruns only element-wise work, which this model does not price: it is priced
    as ``"none"`` (every activation kept: an upper bound; ``benchmarks/recompute_memory.py`` measured
    0.57–0.66x of that kept, at 0.94–0.97x the speed)."""
    return mode == "full" or (mode == "selective" and index % 2 == 0)


def recomputed_blocks(mode: str, blocks: int) -> int:
    """How many of a stage's ``blocks`` rerun their forward under ``Plan.recompute=mode`` (as
    :func:`recomputes` picks them, counted without a loop: the search asks this millions of times)."""
    return blocks if mode == "full" else (blocks + 1) // 2 if mode == "selective" else 0


def op_times(layout: Layout, costs: ModelCosts, replica: ReplicaSpec) -> OpTimes:
    """Per-stage forward/backward seconds for one micro-batch of ``replica``, and transfer seconds.

    Compute is split evenly over the tp ranks; Megatron tensor parallelism adds two all-reduces
    of the hidden states per block in forward and two in backward. Recompute runs the recomputed
    blocks' share of the forward again inside backward (all of it under full recompute).
    """
    b = replica.micro_batch
    passes = [
        stage_pass_s(layout, costs, first, end, unit, b) for (first, end), unit in zip(layout.stages, replica.units)
    ]
    transfer, latency = transfers_s(costs, replica.p2p, b)
    return OpTimes(tuple(f for f, _ in passes), tuple(bwd for _, bwd in passes), transfer, latency)


def stage_pass_s(
    layout: Layout, costs: ModelCosts, first: int, end: int, unit: UnitSpec, b: int
) -> tuple[float, float]:
    """(forward, backward) seconds of one micro-batch of ``b`` on a stage holding layers ``[first, end)`` of
    ``unit``; of the layout it reads only tp, ZeRO ≥ 2 (FSDP's wrappers) and recompute."""
    compute = costs.stage_forward_s(first, end, b, unit.peak_tflops) / layout.tp
    tp_comm = 2 * (end - first) * unit.tp_link.all_reduce_s(costs.boundary_bytes(b), layout.tp)
    wrappers = wrapper_s(layout, costs, first, end, unit.peak_tflops, b)
    f = compute + tp_comm + wrappers
    bwd = costs.backward_ratio * compute + tp_comm + wrappers
    if recomputed := recomputed_blocks(layout.recompute, end - first):
        bwd += f * recomputed / (end - first)
    return f, bwd


def transfers_s(costs: ModelCosts, p2p: tuple[Link, ...], b: int) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """(seconds, the latency part of them) of one micro-batch's activations over each stage-to-stage link.
    One transfer per micro-batch, between computes: each starts on an idle link, with its burst."""
    hidden_bytes = costs.boundary_bytes(b)
    transfer = tuple(link.seconds(hidden_bytes) - link.burst_s(hidden_bytes) for link in p2p)
    return transfer, tuple(min(link.latency_us * 1e-6, t) for link, t in zip(p2p, transfer))


def transfers_line(costs: ModelCosts, p2p: tuple[Link, ...]) -> tuple[float, float]:
    """A replica's stage-to-stage seconds a micro-batch, summed over its boundaries, as (fixed, per sample):
    the line through 1 and 2 samples, as the search extends transfers to any micro-batch."""
    one, two = (sum(transfers_s(costs, p2p, b)[0]) for b in (1, 2))
    return 2 * one - two, two - one


def wrapper_s(layout: Layout, costs: ModelCosts, first: int, end: int, peak_tflops: float, samples: int) -> float:
    """Seconds per pass that the runtime adds to a stage holding layers ``[first, end)`` at a micro-batch
    of ``samples``: FSDP's hooks and copies per unit (each block and the stage's root) under ZeRO-2/3,
    and under tensor parallelism what each block costs beyond its compute share and link all-reduces
    (:func:`~tessera.planner.live.inputs.tensor_parallel_overhead`); measured by a live profile on the
    reference device, scaled by speed like compute."""
    units = (end - first + 1) * costs.fsdp_unit_s if layout.zero >= 2 else 0.0
    blocks = (end - first) * costs.tp_block_at(samples) if layout.tp > 1 else 0.0
    return (units + blocks) * costs.ref_tflops / peak_tflops


def grad_sync_s(layout: Layout, costs: ModelCosts, stage: int) -> float:
    """Data-parallel gradient synchronisation of one stage's parameters (fp32 gradients).

    ZeRO-0 moves one all-reduce's volume, in one all-reduce per DDP bucket (each pays the ring's
    latency: on a WAN that, not the volume, can be the sync) or one flat one under a pipeline.
    FSDP (ZeRO-2/3) works unit by unit (each block and the
    stage's root): it reduce-scatters once per step and gathers the parameters for every
    micro-batch's forward, and under ZeRO-3 again for its backward, so without a pipeline it
    moves (m + 1)/2 and (2m + 1)/2 all-reduces' volume (on gloo, whose reduce-scatter is a whole
    all-reduce, half an all-reduce more) and pays the latency of every one of those per-unit
    collectives; on gloo, whose collectives block the compute thread, each of those starts on a link that
    idled through the previous unit's compute, so it passes the link's burst (``Link.burst_bytes``) at
    once. Under a pipeline the schedule keeps parameters gathered between
    micro-batches: one volume for ZeRO-2, 1.5 for ZeRO-3 (not measured yet). ZeRO-1 (Tessera's:
    DDP's all-reduce, then one broadcast per parameter piece from its owner) adds an all-gather's
    volume and one collective latency per parameter tensor.
    """
    first, end = layout.stages[stage]
    grad_bytes = 4 * costs.stage_params(first, end) / layout.tp
    link, dp = layout.dp_links[stage], layout.dp
    if dp <= 1:
        return 0.0
    if layout.zero >= 2:
        # FSDP: one gather per unit (each block, and the stage's root) per use, and one reduce-scatter;
        # a ring step moves 1/dp of the unit and pays a latency: dp − 1 steps per gather, and per
        # reduce-scatter as many, or twice that on gloo (which all-reduces the whole buffer).
        m = layout.microbatches if layout.pp == 1 else 1
        gathers = (2 if layout.zero == 3 else 1) * m if layout.pp == 1 else (2 if layout.zero == 3 else 1)
        steps = gathers * (dp - 1) + link.reduce_scatter_steps(dp)
        step_volume = grad_bytes / dp / (link.bandwidth_gbs * 1e9)
        if layout.zero == 3:  # the backward's gathers leave the root out: it stays gathered from the forward
            root = 4 * (costs.stage_params(first, end) - (end - first) * costs.parts["block"].params) / layout.tp
            seconds_root = (gathers // 2) * (dp - 1) * (root / dp / (link.bandwidth_gbs * 1e9) + link.latency_us * 1e-6)
        else:
            seconds_root = 0.0
        units = end - first + 1
        seconds = steps * (step_volume + units * link.latency_us * 1e-6) - seconds_root
        if layout.pp == 1 and not link.has_streams:
            # gloo issues each unit's collectives on the compute thread, so the link idles while a unit computes
            # and the next collective starts with its burst (a shaper's bucket refilled meanwhile): once per
            # unit and forward, and per unit and backward (ZeRO-3: a unit's reduce-scatter and the next gather
            # go back to back; ZeRO-2: the last micro-batch's reduce-scatters).
            gaps = gathers + (layout.zero == 2)
            seconds -= units * gaps * link.burst_s((dp - 1) * grad_bytes / dp / units)
        return seconds
    # One all-reduce per bucket: DDP's buckets (tensor parallel: replicate's unit per block) without a
    # pipeline; one flat one under a pipeline.
    calls = 1
    if layout.pp == 1:
        calls = end - first + 1 if layout.tp > 1 else math.ceil(grad_bytes / BUCKET_BYTES)
    seconds = link.all_reduce_s(grad_bytes, dp, calls)
    if layout.zero == 1:
        # The gradients are all-reduced whole (DDP); after the step each owner broadcasts its pieces, one
        # collective (and one latency) per parameter tensor.
        seconds += owner_broadcasts_s(layout, stage, grad_bytes)
        seconds += costs.stage_tensors(first, end) * link.latency_us * 1e-6
    return seconds


MAX_TREE_RANKS = 64  # beyond this the gloo trees are not walked (n² sends per stage): an all-gather's volume


def owner_broadcasts_s(layout: Layout, stage: int, grad_bytes: float) -> float:
    """Bytes' time of ZeRO-1's gather: every data-parallel rank broadcasts its 1/dp of ``grad_bytes``.

    On gloo a broadcast walks a binomial tree (:func:`gloo_broadcast_tree`) and the owners go in turn
    (Tessera issues their pieces in parameter order); with many pieces in flight an owner's turn takes
    as long as its busiest node pair needs to carry what the tree sends over it. On the testbed, whose b–c
    pair is the one slow link, that is two thirds of a ring all-gather's time (benchmarks/gloo_collectives.py).
    Elsewhere (NCCL's pipelined ring broadcast, or nodes not known) a broadcast moves the piece once over the
    group's slowest link: an all-gather's volume.
    """
    link, dp = layout.dp_links[stage], layout.dp
    if link.backend == "gloo" and len(layout.dp_groups) > stage and 1 < dp <= MAX_TREE_RANKS:
        return grad_bytes / dp * _tree_seconds_per_piece_byte(layout.dp_groups[stage], layout.node_links)
    return link.all_reduce_s(grad_bytes, dp) / 2


def gloo_broadcast_tree(n: int, root: int) -> list[tuple[int, int]]:
    """The sends of one gloo broadcast over ``n`` ranks from ``root``, as (sender, receiver), in the order they
    can happen: gloo numbers ranks from the root (virtual rank (r − root) mod n) and in round i every virtual
    rank below 2^i sends to the one 2^i above it (gloo/broadcast.cc). The root sends in every round without
    waiting; a receiver forwards once its round's buffer is in."""
    sends = []
    for i in range(max(n - 1, 0).bit_length()):
        for v in range(1 << i):
            if v + (1 << i) < n:
                sends.append(((v + root) % n, (v + (1 << i) + root) % n))
    return sends


def gloo_owner_turns_s(
    members: tuple[str, ...], node_links: tuple[tuple[str, str, Link], ...], piece_bytes: float
) -> list[float]:
    """Each owner's turn at broadcasting ``piece_bytes`` to a group whose ranks sit on ``members`` (node names):
    what its tree sends over its busiest directed node pair, at that pair's bandwidth."""
    links = {frozenset((a, b)): link for a, b, link in node_links}
    turns = []
    for root in range(len(members)):
        load: dict[tuple[str, str], int] = {}
        for src, dst in gloo_broadcast_tree(len(members), root):
            hop = (members[src], members[dst])
            load[hop] = load.get(hop, 0) + 1
        turns.append(max(n * piece_bytes / (links[frozenset(hop)].bandwidth_gbs * 1e9) for hop, n in load.items()))
    return turns


@functools.lru_cache(maxsize=4096)
def _tree_seconds_per_piece_byte(members: tuple[str, ...], node_links: tuple[tuple[str, str, Link], ...]) -> float:
    return sum(gloo_owner_turns_s(members, node_links, 1.0))


def optimizer_s(layout: Layout, costs: ModelCosts, stage: int, unit: UnitSpec) -> float:
    """Adam step time: memory-bound over fp32 params, grads and two moments; on the host when offloaded."""
    first, end = layout.stages[stage]
    local = costs.stage_params(first, end) / layout.tp / (layout.dp if layout.zero >= 1 else 1)
    if layout.offload:
        host = unit.host_bandwidth_gbs or HOST_BANDWIDTH_GBS
        return 2 * HOST_LINK.seconds(4 * local) + 16 * local / (host * 1e9)
    return 16 * local / (unit.bandwidth_gbs * 1e9)


# --------------------------------------------------------------------- from a Plan
def ranks_of(plan: Plan, cluster: Cluster) -> int:
    """How many ranks ``plan`` runs on ``cluster``: one per placed device, or one per device."""
    return len(plan.placement) if plan.placement is not None else cluster.world_size


def layout_from_plan(plan: Plan, cluster: Cluster, costs: ModelCosts, global_batch: int) -> Layout:
    """The Layout of a resolved ``plan`` on ``cluster`` (rank i runs on cluster device
    ``plan.device_of(i)``, in the cluster file's order)."""
    if plan.replicas is not None:  # replicas of different depth: no grid
        return mixed_layout_from_plan(plan, cluster, costs, global_batch)  # type: ignore[return-value]
    world = ranks_of(plan, cluster)
    plan = plan.resolve(world)
    devices = cluster.devices()
    order = [plan.device_of(rank) for rank in range(world)]
    ranges = plan.pipeline.stage_ranges(costs.n_layers, plan.pp)
    if len(ranges) != plan.pp:
        raise PlanError(
            "the planner models one stage per pipeline rank (gpipe, 1f1b); interleaved plans are not costed."
        )
    samples = plan.samples_per_rank(global_batch)
    m = plan.pipeline.microbatches
    columns, placed = [], []
    for r in range(plan.dp):
        units, nodes = [], []
        for s in range(plan.pp):
            ranks = [order[plan.rank_at(RankCoords(pp=s, dp=r, tp=t))] for t in range(plan.tp)]
            units.append(unit_of(cluster, [devices[i] for i in ranks], costs.precision))
            nodes.append(devices[ranks[0]][0])
        if samples[r] % m:
            raise PlanError(
                f"data-parallel rank {r} takes {samples[r]} samples, which Plan.pipeline.microbatches={m} "
                "does not divide."
            )
        columns.append((tuple(units), samples[r] // m))
        placed.append(tuple(nodes))
    p2p = pipeline_links(cluster, placed)
    replicas = [ReplicaSpec(1, units, links, b) for (units, b), links in zip(columns, p2p)]
    dp_links = tuple(
        cluster.worst_link({devices[order[plan.rank_at(RankCoords(pp=s, dp=r))]][0] for r in range(plan.dp)})
        for s in range(plan.pp)
    )
    return Layout(
        plan.pp, plan.dp, plan.tp, ranges, m, plan.pipeline.schedule, plan.zero, plan.offload, plan.recompute,
        tuple(replicas), dp_links, tuple(placed), links_among(cluster, placed),
        tuple(tuple(nodes[s] for nodes in placed) for s in range(plan.pp)),
    )  # fmt: skip


def pipeline_links(cluster: Cluster, columns: list[tuple[str, ...]]) -> list[tuple[Link, ...]]:
    """Each replica's links from stage s to s + 1 (``columns``: each replica's node per stage), each shared by
    every replica whose pipeline crosses the same pair of nodes the same way: alike replicas run their
    schedules in step, so their transfers cross at once (the simulator splits the link between them too)."""
    crossing = Counter(pair for column in columns for pair in set(zip(column, column[1:])))
    return [tuple(cluster.link(a, b).shared_by(crossing[(a, b)]) for a, b in zip(c, c[1:])) for c in columns]


def links_among(cluster: Cluster, nodes: list[tuple[str, ...]] | tuple[tuple[str, ...], ...]) -> tuple:
    """Every pair of the named nodes (each with itself too: its intra-node link) with its link."""
    used = sorted({node for row in nodes for node in row})
    return tuple((a, b, cluster.link(a, b)) for i, a in enumerate(used) for b in used[i:])


def unit_of(cluster: Cluster, members: list, dtype: str) -> UnitSpec:
    """The UnitSpec of a tp group: the slowest peak for ``dtype``, the smallest memory, the slowest inner link."""
    types = [t for _, _, t in members]
    for t in types:
        if t.peak(dtype) is None:
            raise PlanError(
                f"device type {t.name} has no {dtype} figure (no fast path for it): plan with precision auto (fp16 "
                f"with loss scaling where bf16 is missing) or another precision, or give "
                f"device_types.{t.name}.peak_tflops.{dtype} in the cluster file."
            )
    slow = min(types, key=lambda t: t.peak_tflops[dtype])
    nodes = {node for node, _, _ in members}
    return UnitSpec(
        slow.name,
        slow.peak_tflops[dtype],
        min(t.memory_gib for t in types) * 2**30 * USABLE_MEMORY,
        min(t.bandwidth_gbs for t in types),
        cluster.worst_link(nodes),
        min(t.host_bandwidth_gbs or HOST_BANDWIDTH_GBS for t in types),
        min(t.comm_overlap for t in types),
    )


def sync_groups(
    parts: tuple[Layout, ...], devices: tuple[tuple[int, ...], ...], cluster: Cluster, costs: ModelCosts
) -> tuple[SyncGroup, ...]:
    """The all-reduce groups of replicas ``parts`` placed on cluster ``devices`` (each replica's, stage by
    stage, tp ranks within a stage; ranks in that order), as the runtime's ``LayerSync`` forms them: each
    parameter averaged over the ranks holding it, one per replica (a tied head's weight: every copy), a
    parameter that tp replicas split cut into lcm(tp) pieces, each held by one tp rank of each such replica."""
    pieces = math.lcm(*(p.tp for p in parts))
    names = cluster.devices()
    first_rank = [sum(len(d) for d in devices[:i]) for i in range(len(devices))]

    def stage_of(part: Layout, layer: int) -> int:
        return next(s for s, (a, b) in enumerate(part.stages) if a <= layer < b)

    last = costs.n_layers - 1
    owners = [([0], costs.parts["first"].params), ([last], costs.parts["last"].params - costs.shared_params)]
    owners += [([layer], costs.parts["block"].params) for layer in range(costs.n_layers)]
    owners.append(([0, last], costs.shared_params))  # a tied head: the embedding's copies on both stages
    params: dict[tuple[tuple[int, int, int], ...], float] = {}
    for layers, count in owners:
        for k in range(pieces):
            key = tuple(
                sorted({(i, stage_of(p, layer), k * p.tp // pieces) for i, p in enumerate(parts) for layer in layers})
            )
            params[key] = params.get(key, 0.0) + count / pieces
    groups = []
    for holders, count in params.items():
        if count <= 0 or len(holders) < 2:
            continue
        placed = [(first_rank[i] + s * parts[i].tp + t, devices[i][s * parts[i].tp + t]) for i, s, t in holders]
        nodes = frozenset(names[d][0] for _, d in placed)
        ranks = tuple(sorted(r for r, _ in placed))
        groups.append(SyncGroup(holders, ranks, count, cluster.worst_link(set(nodes)), nodes))
    return tuple(sorted(groups, key=lambda g: g.ranks))


def mixed_layout_from_plan(plan: Plan, cluster: Cluster, costs: ModelCosts, global_batch: int) -> MixedLayout:
    """The MixedLayout of a ``Plan.replicas`` plan on ``cluster`` (rank i on device ``plan.device_of(i)``)."""
    assert plan.replicas is not None
    world = ranks_of(plan, cluster)
    plan = plan.resolve(world)
    devices = cluster.devices()
    samples = plan.samples_per_rank(global_batch)
    m = plan.pipeline.microbatches
    r = len(plan.replicas)
    link = cluster.worst_link({devices[plan.device_of(i)][0] for i in range(world)})  # each part's dp_links
    parts, placed = [], []
    for i, (replica, n) in enumerate(zip(plan.replicas, samples)):
        ranks = plan.replica_ranks(i)
        if n % m:
            raise PlanError(
                f"Plan.replicas[{i}] takes {n} samples, which Plan.pipeline.microbatches={m} does not divide."
            )
        members = [plan.device_of(rank) for rank in ranks]
        groups = [members[s * replica.tp : (s + 1) * replica.tp] for s in range(replica.depth)]  # each stage's tp
        units = tuple(unit_of(cluster, [devices[d] for d in group], costs.precision) for group in groups)
        nodes = [devices[group[0]][0] for group in groups]
        p2p = tuple(cluster.link(a, b) for a, b in zip(nodes, nodes[1:]))
        spec = ReplicaSpec(1, units, p2p, n // m)
        parts.append(
            Layout(replica.depth, r, replica.tp, replica.stages, m, plan.pipeline.schedule, 0, False, plan.recompute,
                   (spec,), (link,) * replica.depth, grads_freed=True)
        )  # fmt: skip
        placed.append(tuple(members))
    return MixedLayout(tuple(parts), sync_groups(tuple(parts), tuple(placed), cluster, costs), tuple(placed))
