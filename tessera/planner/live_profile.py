"""A live profile: what every rank of a launched job measures on its own device and its own links.

``tessera cluster profile`` launches one rank per cluster device (over the real launcher: on a
GPU cluster the same command, on this machine optionally the testbed). Each rank

- times the model's parts on its device (:func:`~tessera.planner.profile.profile_model`: the
  first part, one block, the last part, forward and backward, per micro-batch size),
- times an AdamW step over one block's parameters (the optimizer's memory speed), and
- records its peak memory;

and for every pair of nodes one rank of each times ping-pongs (latency) and large transfers
(bandwidth: the slope between one push and several back to back, so a token bucket's burst and
the latency cancel) between them, then one push after the link has idled (what it passes at once:
a shaper's burst), and two ranks of a node do the same for the intra-node link.
The two first ranks of the fastest node with two time the whole model plain and tensor parallel
between them (:class:`TensorParallelMeasurement`): what a sharded block costs beyond its compute
share and its all-reduces on the link. Last, every rank joins a gradient-sized all-reduce and a
tiny one. Rank 0 writes the result as JSON.

The planner then plans from the measurements instead of the cluster file's declared figures:
:func:`measured_cluster` gives each node a device type whose speed is the node's measured
block time relative to the fastest node's, whose memory speed is the measured optimizer
speed, and links with the measured bandwidth and latency; :func:`measured_costs` gives
per-part costs from the fastest node's own profiles (their median).

Example:
    >>> live = LiveProfile.load("cluster-profile.json")
    >>> analytic = ModelCosts.from_model(model, seq_len=64)
    >>> plan_for(measured_cluster(cluster, live), model, 32, costs=measured_costs(live, analytic))
"""

from __future__ import annotations

import copy
import json
import math
import resource
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from itertools import combinations
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from tessera.cluster.catalog import DeviceType
from tessera.cluster.detect import median_seconds
from tessera.cluster.spec import Cluster, Link
from tessera.errors import PlanError
from tessera.planner.costs import ModelCosts, fit_line
from tessera.planner.profile import Profile, profile_model

# Micro-batch sizes every part, and tensor parallelism, are timed at (``tessera cluster profile`` keeps
# those up to the global batch): plans use 1 to 32 samples on the testbed, and a line through 1, 2 and
# 4 put a 16-sample step 30% too fast there.
SIZES = (1, 4, 16, 32)
TRANSFER_BYTES = 2 << 20  # one push of a bandwidth sample
PUSHES = 4  # back to back: bandwidth is the slope between 1 and PUSHES pushes (a bucket's burst cancels)
PING_REPEATS = 9
PUSH_REPEATS = 3
# The burst probe: one push of about this many seconds at the measured bandwidth (so a burst of a few
# milliseconds' bytes is a clear share of it), after the link idled twice as long, BURST_REPEATS times.
BURST_WINDOW_S = 0.05
BURST_REPEATS = 5
# Each timing covers at least this many seconds of calls: a CPU quota throttles per 10 ms period, so
# one short call can run at full speed where a step would not.
WINDOW_S = 0.2
REPEATS = 5


@dataclass
class RankMeasurement:
    """One rank's device: its parts' times (a :class:`Profile`), optimizer speed and peak memory."""

    rank: int
    device: int  # the cluster device it played (file order)
    node: str
    device_type: str  # as declared in the cluster file
    profile: Profile
    optimizer_gbs: float  # bytes an AdamW step moves (16 per parameter) per second, on the device
    peak_bytes: int
    memory_source: str  # "cuda max allocated" or "process max RSS"
    host_optimizer_gbs: float = 0.0  # the same on this rank's host CPU (where offload would step it)
    # What FSDP's hooks and copies add on this device, per unit (a block, or the root) and pass (a
    # forward or a backward), measured on a one-rank mesh (no communication):
    fsdp_unit_s: float = 0.0
    comm_overlap: float = 1.0  # share of a concurrent all-reduce's time its compute did not lose (measure_comm_overlap)

    def block_s(self) -> float:
        """Forward plus backward of one block, summed over the profiled micro-batch sizes (one size's
        backward, a difference of two timings, is noisier than the sum)."""
        block = self.profile.layers["block"]
        return sum(block.forward_s.values()) + sum(block.backward_s.values())


@dataclass
class LinkMeasurement:
    """A link timed between two ranks: one-way latency and achieved bandwidth."""

    nodes: tuple[str, str]
    ranks: tuple[int, int]
    bandwidth_gbs: float
    latency_us: float
    # Bus bandwidth of an all-reduce between the two ranks: unlike a send, it includes what both members'
    # processors do for a collective (gloo copies and reduces on the CPU, a throttled one slowly). Shown,
    # not priced: rings of more ranks ran at the send rate (see _measured_link).
    all_reduce_gbs: float = 0.0
    burst_bytes: float = 0.0  # what the link passed at once after idling (burst_from_push)


@dataclass
class TensorParallelMeasurement:
    """The whole model's forward and backward per micro-batch size, plain on one rank and tensor
    parallel over ``ranks`` (two ranks of ``node``, the fastest node with two), timed together.

    What a tp block costs beyond its share of the compute and the all-reduces the link model
    prices (DTensor dispatch, smaller and slower matmuls, waiting for the partner at every
    blocking all-reduce) is derived from these by :func:`tensor_parallel_overhead`."""

    node: str
    ranks: tuple[int, ...]
    plain_s: dict[int, float]  # micro-batch size -> seconds, the unsharded model on one rank
    sharded_s: dict[int, float]  # the same, sharded over ``ranks``
    # Peak bytes a forward and backward allocates beyond what is held before it, at the largest size:
    plain_peak_bytes: int = 0
    sharded_peak_bytes: int = 0


@dataclass
class FsdpPairMeasurement:
    """The whole model's forward and backward at one sample, plain and under ``fully_shard`` (a unit per
    block and the root) over ``ranks``, two ranks of ``node`` (the fastest with two), timed together.

    A one-rank group (:attr:`RankMeasurement.fsdp_unit_s`) shows FSDP's hooks but not what a real group
    adds: copying every unit's parameters into the gather buffer and out of it, its gradients into the
    reduce-scatter buffer, and the collectives themselves on the compute thread (gloo). On the testbed
    ZeRO-2 on two ranks was predicted 23% fast from the one-rank figure, 12% from the pair's.
    :func:`fsdp_unit_overhead` derives the per-unit cost from it."""

    node: str
    ranks: tuple[int, ...]
    plain_s: float
    sharded_s: float


@dataclass
class LiveProfile:
    """Everything one ``tessera cluster profile`` job measured."""

    model_key: str
    seq_len: int
    precision: str
    where: str  # "testbed <name>" or the machine(s) it ran on
    ranks: list[RankMeasurement]
    links: list[LinkMeasurement] = field(default_factory=list)
    collective_latency_us: float = 0.0  # one tiny all-reduce over every rank
    all_reduce_gbs: float = 0.0  # bus bandwidth of a gradient-sized all-reduce over every rank
    tensor_parallel: TensorParallelMeasurement | None = None  # None: no node has two ranks
    backend: str = "nccl"  # the collectives library the ranks ran (its links' Link.backend)
    fsdp_pair: FsdpPairMeasurement | None = None  # None: no node has two ranks

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1)

    def save(self, path: str | Path) -> Path:
        Path(path).write_text(self.to_json() + "\n")
        return Path(path)

    @classmethod
    def load(cls, path: str | Path) -> LiveProfile:
        try:
            data = json.loads(Path(path).read_text())
            ranks = [
                RankMeasurement(**{**r, "profile": Profile.from_json(json.dumps(r["profile"]))}) for r in data["ranks"]
            ]
            links = [
                LinkMeasurement(**{**k, "nodes": tuple(k["nodes"]), "ranks": tuple(k["ranks"])}) for k in data["links"]
            ]
            if (tp := data.get("tensor_parallel")) is not None:
                tp = TensorParallelMeasurement(
                    tp["node"],
                    tuple(tp["ranks"]),
                    {int(b): t for b, t in tp["plain_s"].items()},
                    {int(b): t for b, t in tp["sharded_s"].items()},
                    tp.get("plain_peak_bytes", 0),
                    tp.get("sharded_peak_bytes", 0),
                )
            if (pair := data.get("fsdp_pair")) is not None:
                pair = FsdpPairMeasurement(**{**pair, "ranks": tuple(pair["ranks"])})
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise PlanError(
                f"{path} is not a live profile ({type(exc).__name__}: {exc}): write one with `tessera cluster profile`."
            ) from None
        return cls(**{**data, "ranks": ranks, "links": links, "tensor_parallel": tp, "fsdp_pair": pair})


# ------------------------------------------------------------------------ measuring (every rank)
def measure_rank(
    model: nn.Module,
    cluster: Cluster,
    device_index: int,
    seq_len: int,
    device: torch.device,
    batch_sizes: tuple[int, ...] = SIZES,
    repeats: int = REPEATS,
    window_s: float = WINDOW_S,
) -> RankMeasurement:
    """Profile ``model``'s parts and an optimizer step on this rank's ``device``."""
    node, _, device_type = cluster.devices()[device_index]
    profile = profile_model(model, batch_sizes, seq_len, device, device_type.name, repeats, window_s)
    return RankMeasurement(
        dist.get_rank(),
        device_index,
        node,
        device_type.name,
        profile,
        _optimizer_gbs(model, device),
        *_peak_memory(device),
        _optimizer_gbs(model, torch.device("cpu")) if device.type != "cpu" else 0.0,
    )


def _largest_asked(device: torch.device, group: dist.ProcessGroup | None = None) -> Callable[[int], int]:
    """``calls -> the largest number any rank of group asked for``: ranks that time a collective must all
    run it the same number of times, whatever their own calibration said."""

    def largest(calls: int) -> int:
        count = torch.tensor([calls], device=device)
        dist.all_reduce(count, op=dist.ReduceOp.MAX, group=group)
        return int(count.item())

    return largest


def _step_seconds(model: nn.Module, tokens: torch.Tensor, repeats: int, window_s: float, agree: Any = None) -> float:
    """Median seconds of one forward and backward of ``model`` on ``tokens``."""

    def step() -> None:
        model(tokens).float().mean().backward()

    seconds = median_seconds(step, repeats, window_s, agree=agree)
    model.zero_grad(set_to_none=True)
    return seconds


def _plain_and_sharded_seconds(
    model: nn.Module, seq_len: int, device: torch.device, group: dist.ProcessGroup, repeats: int, window_s: float
) -> tuple[float, float]:
    """Seconds of a forward and backward of ``model`` at one sample, plain and under ``fully_shard`` over
    ``group`` (a unit per block and the root); every member of ``group`` calls this."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard

    from tessera.parallel.data_parallel import repeated_blocks

    mesh = DeviceMesh.from_group(group, device.type)
    torch.manual_seed(1)  # the same tokens on every member
    tokens = torch.randint(0, model.config.vocab_size, (1, seq_len), device=device)
    plain = _step_seconds(model, tokens, repeats, window_s)
    sharded = copy.deepcopy(model)
    for block in repeated_blocks(sharded):
        fully_shard(block, mesh=mesh)
    fully_shard(sharded, mesh=mesh)
    agree = _largest_asked(device, group) if group.size() > 1 else None  # members run as many collectives
    dist.barrier(group=group)
    return plain, _step_seconds(sharded, tokens, repeats, window_s, agree=agree)


def measure_fsdp_overhead(
    model: nn.Module,
    seq_len: int,
    device: torch.device,
    alone: dist.ProcessGroup,
    repeats: int = REPEATS,
    window_s: float = WINDOW_S,
) -> float:
    """Seconds per FSDP unit and pass on this rank's device: a forward and backward of the whole
    model at micro-batch 1, plain and under ``fully_shard`` on ``alone`` (a one-rank group: hooks and
    copies, but no transfer; the predictors add transfers from the links). A throttled CPU pays these
    in full; profiling bare blocks missed them, and ZeRO-2 was predicted 45% too fast. Where a node
    has two ranks, :class:`FsdpPairMeasurement` replaces this.
    """
    from tessera.parallel.data_parallel import repeated_blocks

    plain, sharded = _plain_and_sharded_seconds(model, seq_len, device, alone, repeats, window_s)
    return max(sharded - plain, 0.0) / (2 * (len(repeated_blocks(model)) + 1))


def measure_fsdp_pair(
    model: nn.Module,
    seq_len: int,
    device: torch.device,
    node: str,
    ranks: tuple[int, ...],
    group: dist.ProcessGroup,
    repeats: int = REPEATS,
    window_s: float = WINDOW_S,
) -> FsdpPairMeasurement:
    """Time FSDP over a real two-rank ``group`` (``ranks`` of ``node``); only the members call this."""
    plain, sharded = _plain_and_sharded_seconds(model, seq_len, device, group, repeats, window_s)
    return FsdpPairMeasurement(node, tuple(ranks), plain, sharded)


def tensor_parallel_pair(live_ranks: list[tuple[str, float]]) -> tuple[str, tuple[int, int]] | None:
    """The node whose two first ranks time tensor parallelism and FSDP: the fastest (median block seconds) of
    the nodes with two ranks or more; ``live_ranks`` is (node, block seconds) per rank. None: no such node."""
    by_node: dict[str, list[int]] = {}
    for rank, (node, _) in enumerate(live_ranks):
        by_node.setdefault(node, []).append(rank)
    pairs = {node: ranks for node, ranks in by_node.items() if len(ranks) >= 2}
    if not pairs:
        return None
    node = min(pairs, key=lambda n: statistics.median(live_ranks[r][1] for r in pairs[n]))
    return node, (pairs[node][0], pairs[node][1])


def measure_tensor_parallel(
    model: nn.Module,
    seq_len: int,
    device: torch.device,
    node: str,
    ranks: tuple[int, ...],
    group: dist.ProcessGroup,
    batch_sizes: tuple[int, ...] = SIZES,
    repeats: int = REPEATS,
    window_s: float = WINDOW_S,
) -> TensorParallelMeasurement:
    """Time the whole model's forward and backward, plain and sharded by the policy's tensor-parallel
    plan over ``group`` (``ranks``), at each micro-batch size. Only the members call this."""
    from torch.distributed.device_mesh import DeviceMesh

    from tessera.models.policies import policy_for
    from tessera.parallel.tensor import apply_tensor_parallel

    mesh = DeviceMesh.from_group(group, device.type)
    sharded = apply_tensor_parallel(copy.deepcopy(model), model, policy_for(model, "the profiler"), mesh)

    largest = _largest_asked(device, group)  # both members must run the same number of collectives
    plain, split = {}, {}
    for b in batch_sizes:
        torch.manual_seed(b)  # the same tokens on both members, as tensor parallelism requires
        tokens = torch.randint(0, model.config.vocab_size, (b, seq_len), device=device)
        plain[b] = _step_seconds(model, tokens, repeats, window_s)
        dist.barrier(group=group)
        split[b] = _step_seconds(sharded, tokens, repeats, window_s, agree=largest)
    peaks = [_transient_bytes(m, tokens, device) for m in (model, sharded)]  # at the largest size
    return TensorParallelMeasurement(node, tuple(ranks), plain, split, *peaks)


def _transient_bytes(model: nn.Module, tokens: torch.Tensor, device: torch.device) -> int:
    """Peak bytes one forward and backward of ``model`` allocates beyond what was held before it."""
    from tessera.memory import peak_tensor_bytes

    before = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
    with peak_tensor_bytes(device, 0) as peak:
        model(tokens).float().mean().backward()
    model.zero_grad(set_to_none=True)
    return peak[0] - before


def _optimizer_gbs(model: nn.Module, device: torch.device, repeats: int = 3) -> float:
    """AdamW's memory speed: 16 bytes per parameter (weight, gradient, two moments) over its step time."""
    params = [torch.randn_like(p, device=device, requires_grad=True) for p in model.parameters()][:64]
    for p in params:
        p.grad = torch.randn_like(p)
    optimizer = torch.optim.AdamW(params, lr=1e-4)
    optimizer.step()  # creates the moments
    seconds = median_seconds(optimizer.step, repeats, WINDOW_S)
    return 16 * sum(p.numel() for p in params) / max(seconds, 1e-9) / 1e9


def _peak_memory(device: torch.device) -> tuple[int, str]:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device), "cuda max allocated"
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, "process max RSS"


def measure_links(cluster: Cluster, rank_devices: list[int], device: torch.device) -> list[LinkMeasurement]:
    """Time every pair of nodes (one rank of each) and each node's own link (two of its ranks).

    Every rank must call this; pairs are timed one after another, so each has its link alone."""
    devices = cluster.devices()
    node_ranks: dict[str, list[int]] = {}
    for rank, d in enumerate(rank_devices):
        node_ranks.setdefault(devices[d][0], []).append(rank)
    pairs = [((a, b), (node_ranks[a][0], node_ranks[b][0])) for a, b in combinations(node_ranks, 2)]
    pairs += [((a, a), (ranks[0], ranks[1])) for a, ranks in node_ranks.items() if len(ranks) > 1]
    found = []
    for nodes, ranks in pairs:
        group = dist.new_group(sorted(ranks))  # every rank creates every group, in the same order
        timed = _time_pair(*ranks, group, device)
        if timed is not None:
            found.append(LinkMeasurement(nodes, ranks, *timed))
        dist.barrier()
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, found)
    return [link for part in gathered for link in part]


def _time_pair(
    src: int, dst: int, pair: dist.ProcessGroup, device: torch.device
) -> tuple[float, float, float, float] | None:
    """(bandwidth GB/s, one-way latency µs, all-reduce bus bandwidth GB/s, burst bytes) of src → dst,
    measured on src; None on other ranks."""
    me = dist.get_rank()
    if me not in (src, dst):
        return None
    peer = dst if me == src else src
    small = torch.zeros(1, device=device)
    big = torch.zeros(TRANSFER_BYTES // 4, device=device)

    def exchange(payload: torch.Tensor, times: int = 1) -> float:
        """Seconds for ``times`` back-to-back sends of ``payload`` and one acknowledgement."""
        start = time.perf_counter()
        if me == src:
            for _ in range(times):
                dist.send(payload, peer)
            dist.recv(small, peer)
        else:
            for _ in range(times):
                dist.recv(payload, peer)
            dist.send(small, peer)
        return time.perf_counter() - start

    exchange(small)  # warm-up: connects the pair
    latency = statistics.median(exchange(small) for _ in range(PING_REPEATS)) / 2
    one = statistics.median(exchange(big) for _ in range(PUSH_REPEATS))
    many = statistics.median(exchange(big, PUSHES) for _ in range(PUSH_REPEATS))
    bandwidth = (PUSHES - 1) * TRANSFER_BYTES / max(many - one, 1e-9) / 1e9
    dist.all_reduce(big, group=pair)  # warm-up
    reduced = []
    for _ in range(PUSH_REPEATS):
        start = time.perf_counter()
        dist.all_reduce(big, group=pair)
        reduced.append(time.perf_counter() - start)
    bus = TRANSFER_BYTES / statistics.median(reduced) / 1e9  # 2(n − 1)/n × bytes / time, n = 2
    # One push after the link idled: both ranks meet (a ping-pong), wait, and the push goes at once (the
    # receiver posted its receive a latency before the sender sends). Its size follows the sender's
    # bandwidth, which the receiver (whose timings differ) takes from it.
    agreed = torch.tensor([bandwidth if me == src else 0.0], dtype=torch.float64, device=device)
    dist.all_reduce(agreed, group=pair)
    bandwidth = float(agreed.item())
    probe_bytes = int(min(TRANSFER_BYTES, max(64 << 10, bandwidth * 1e9 * BURST_WINDOW_S))) // 4 * 4
    probe = big[: probe_bytes // 4]
    idle = 2 * probe_bytes / (bandwidth * 1e9) + 0.01
    after_idle = []
    for _ in range(BURST_REPEATS):
        exchange(small)
        time.sleep(idle)
        after_idle.append(exchange(probe))
    burst = burst_from_push(probe_bytes, statistics.median(after_idle), bandwidth, latency)
    return (bandwidth, latency * 1e6, bus, burst) if me == src else None


def burst_from_push(nbytes: int, seconds: float, bandwidth_gbs: float, latency_s: float) -> float:
    """Bytes a link passed at once, from one push of ``nbytes`` after it idled that took ``seconds`` with its
    acknowledgement: ``nbytes`` less what the measured bandwidth moved in the time beyond the two latencies;
    0 when the push took the slope's time or longer (a link without a shaper), at most ``nbytes``."""
    moved = max(seconds - 2 * latency_s, 0.0) * bandwidth_gbs * 1e9
    return min(max(nbytes - moved, 0.0), float(nbytes))


def all_reduce_gbs(device: torch.device, nbytes: int = 4 << 20) -> float:
    """Bus bandwidth (2(n-1)/n × bytes / time) of an all-reduce of ``nbytes`` over every rank.

    Unlike a pair's transfer it includes what every member does for a ring: with gloo, the
    reductions and copies run on each rank's CPU, so a slow rank slows every collective it is in."""
    world = dist.get_world_size()
    if world == 1:
        return 0.0
    t = torch.ones(nbytes // 4, device=device)

    largest = _largest_asked(device)
    seconds = median_seconds(lambda: dist.all_reduce(t), 3, WINDOW_S, agree=largest)
    return 2 * (world - 1) / world * nbytes / seconds / 1e9


def measure_comm_overlap(device: torch.device, nbytes: int = 1 << 20, repeats: int = 3) -> float:
    """Share of an all-reduce's time this rank's compute does not lose when both run at once: with
    ``b`` a window of all-reduces alone, ``a`` a matmul loop alone sized to last as long, and ``c`` the
    same all-reduces started asynchronously with the loop run meanwhile, ``(a + b − c) / min(a, b)``,
    within [0, 1]. Every rank must call this (the all-reduces are collective).

    Each window lasts at least ``WINDOW_S``: a rank held to a CPU quota runs a short call at full
    speed, and one-call timings over a 1 Gbit/s link measured 0 on every testbed rank where windows
    over a 200 Mbit/s link measured 0.73–0.92. 1 when a copy engine and NCCL move the bytes while the
    cores compute; lower where the collective's copies and reductions take the CPU time the compute needs."""
    t = torch.ones(nbytes // 4, device=device)
    x = torch.randn(256, 256, device=device)

    largest = _largest_asked(device)

    def seconds(fn: Any) -> float:
        times = []
        for _ in range(repeats):
            dist.barrier()
            start = time.perf_counter()
            fn()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            times.append(time.perf_counter() - start)
        return statistics.median(times)

    dist.all_reduce(t)  # warm-up: the first collective sets up the ring
    start = time.perf_counter()
    dist.all_reduce(t)
    rounds = largest(max(1, math.ceil(WINDOW_S / max(time.perf_counter() - start, 1e-6))))

    def reduce_all() -> None:
        for _ in range(rounds):
            dist.all_reduce(t)

    b = seconds(reduce_all)
    calls = max(1, round(b / max(median_seconds(lambda: torch.mm(x, x), 3, WINDOW_S), 1e-9)))

    def compute() -> None:
        for _ in range(calls):
            torch.mm(x, x)

    def both() -> None:
        works = [dist.all_reduce(t, async_op=True) for _ in range(rounds)]
        compute()
        for work in works:
            work.wait()

    a, c = seconds(compute), seconds(both)
    return min(max((a + b - c) / max(min(a, b), 1e-9), 0.0), 1.0)


def collective_latency_us(device: torch.device, repeats: int = 20) -> float:
    """Microseconds of one tiny all-reduce over every rank (the median of ``repeats``)."""
    t = torch.ones(1, device=device)
    dist.all_reduce(t)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        dist.all_reduce(t)
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e6


# ------------------------------------------------------------------------ what the planner reads
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
    reduce-scatters priced by the node's link) / (2 passes × units). ``alone_s`` (the one-rank
    measurement) where the profile has no pair."""
    m = live.fsdp_pair
    if m is None:
        return alone_s
    link = _node_link(live, m.node, "FSDP")
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
