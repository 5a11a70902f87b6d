"""Measuring on live ranks: what every rank of a ``tessera cluster profile`` job times on its own device
and its own links.

Each rank times the model's parts on its device (:func:`~tessera.planner.profile.profile_model`: the
first part, one block, the last part, forward and backward, per micro-batch size), an AdamW step over one
block's parameters (the optimizer's memory speed), and records its peak memory. For every pair of nodes
one rank of each times ping-pongs (latency) and large transfers (bandwidth: the slope between one push
and several back to back, so a token bucket's burst and the latency cancel) between them, then one push
after the link has idled (what it passes at once: a shaper's burst), and two ranks of a node do the same
for the intra-node link. The two first ranks of the fastest node with two time the whole model plain and
tensor parallel between them, and plain and under FSDP. Last, every rank joins a gradient-sized
all-reduce and a tiny one. :mod:`.job` is the job's rank entry; :mod:`.inputs` turns the result into
planner inputs.
"""

from __future__ import annotations

import copy
import math
import resource
import statistics
import time
from collections.abc import Callable
from itertools import combinations
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from tessera.cluster.detect import median_seconds
from tessera.cluster.spec import Cluster
from tessera.planner.live.records import (
    FsdpPairMeasurement,
    LinkMeasurement,
    RankMeasurement,
    TensorParallelMeasurement,
)
from tessera.planner.profile import profile_model
from tessera.train.step import logits_of  # a Hugging Face model returns an output object, not logits

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
        logits_of(model(tokens)).float().mean().backward()

    seconds = median_seconds(step, repeats, window_s, agree=agree)
    model.zero_grad(set_to_none=True)
    return seconds


def whole_pass_seconds(
    model: nn.Module, seq_len: int, device: torch.device, repeats: int = REPEATS, window_s: float = WINDOW_S
) -> float:
    """Median seconds of one forward and backward of the whole ``model`` at one sample: timed at a profile's
    start and end, what the device's speed did meanwhile (``RankMeasurement.recheck_s``)."""
    return _step_seconds(model, _one_sample(model, seq_len, device), repeats, window_s)


def _one_sample(model: nn.Module, seq_len: int, device: torch.device) -> torch.Tensor:
    """One sample of tokens, the same on every rank that asks (a fixed seed)."""
    torch.manual_seed(1)
    return torch.randint(0, model.config.vocab_size, (1, seq_len), device=device)


def _plain_and_sharded_seconds(
    model: nn.Module, seq_len: int, device: torch.device, group: dist.ProcessGroup, repeats: int, window_s: float
) -> tuple[float, float]:
    """Seconds of a forward and backward of ``model`` at one sample, plain and under ``fully_shard`` over
    ``group`` (a unit per block and the root); every member of ``group`` calls this."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard

    from tessera.parallel.data_parallel import repeated_blocks

    mesh = DeviceMesh.from_group(group, device.type)
    tokens = _one_sample(model, seq_len, device)  # the same tokens on every member
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


def fastest_two(live_ranks: list[tuple[str, float]]) -> tuple[int, int]:
    """The two fastest ranks (least block seconds), in rank order: FSDP's pair when no node has two ranks."""
    first, second = sorted(range(len(live_ranks)), key=lambda r: (live_ranks[r][1], r))[:2]
    return min(first, second), max(first, second)


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
        logits_of(model(tokens)).float().mean().backward()
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
