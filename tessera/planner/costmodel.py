"""The closed-form cost model: step time and memory per device of a :class:`Layout`, and an OOM verdict.

Time. Each replica runs its ``m`` micro-batches through its stages. Under 1f1b, a micro-batch's
round trip through stage ``s`` (its forward, every later stage's forward and backward with the
transfers, ``D_s``, its backward) takes ``F_s + D_s + B_s``, and at most ``w_s = min(m, pp − s)``
micro-batches are in flight from ``s``. The makespan is the slowest stage's path::

    pipeline = max_s [ Σ_{k<s} (F_k + B_k + 2 c_k)
                       + max( m (F_s + B_s) + max(0, D_s − (w_s − 1) F_s),     # busy
                              F_s + D_s + B_s + R_s ) ]                          # flow
    R_s = (m − 1) max(F_s, L_s)                    when m ≤ w_s (all leave in warm-up)
    R_s = max_{t ≥ s} [ ⌊(m−1)/k⌋ max(O_st, k q) + ((m−1) mod k) q ]   otherwise,
    k = t − s + 1,  O_st = Σ_{j=s..t} (F_j + B_j) + 2 Σ_{j=s..t−1} c_j,
    q = max(F_s + B_s, L_s),  L_s = max_{k>s} (F_k + B_k)

The flow term's loops: 1f1b alternates, so the loop from ``s`` out to stage ``t`` and back holds
one micro-batch per stage, k in all, and lets k through per turn. A slow link near the start
of a long pipeline makes a short loop the tightest; the full round trip (``t`` = last,
``k = w_s``) was the only one counted before, and that was 15% off on such pipelines.

The k micro-batches of such a loop cross each of its stage boundaries one sender's pass apart (its
forward going out, the next stage's backward coming back); where a transfer's bytes take longer than
that pass, they queue on the link: ``latency + c + (k − 1) · max(0, c − pass)`` per crossing (c: the
transfer's bytes over the link), so a link slower than the stages' compute paces the loop. Alike replicas
whose pipelines cross the same node pair share that link, as the simulator's flows do
(:func:`~tessera.planner.layout.pipeline_links`). Before both (issue 35), a pipeline across a 1 Gbit/s
region link was priced as if each transfer had the link alone: 3.6x too fast.

gpipe is two flow shops, forwards then backwards, each link between stages a machine of its own:
``Σ (F + B + 2c) + (m − 1)(max(F, c′) + max(B, c′))``, c′ a transfer less its latency.
The simulator (:mod:`~tessera.planner.simulate`) replays the schedules event by event with its own
model of communication; both are checked against measured testbed runs, not against each other.

Stage ``s`` of a replica finishes its last backward ``Σ_{k<s} (B_k + transfer_k)`` before the
replica's pipeline ends. Every stage's data-parallel group then synchronises gradients (it
waits for its slowest replica: shares are uneven on purpose) and steps its optimizer::

    step = max_s ( max_replica finish_s + grad_sync_s + optimizer_s )

Communication is not overlapped with compute: a conservative model that ranks plans the
same way an overlapping one would whenever communication is small, and says so when it is not.

Memory per device: fp32 parameters, gradients and two Adam moments (16 bytes per parameter),
divided over the data-parallel group by ZeRO stage, minus what offload keeps on the host; saved
activations of the micro-batches a stage holds at once (1f1b: pp − s, gpipe: m; a recomputed block
keeps only its input: every block under full recompute, every second under selective); communication
buffers. A device over its usable memory
(:data:`USABLE_MEMORY` of its capacity) makes the plan infeasible.

Example:
    >>> est = estimate(layout, costs)
    >>> est.step_s, est.fits, est.bottleneck
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from tessera.cluster.spec import Link
from tessera.parallel.data_parallel import BUCKET_BYTES  # DDP's bucket: the all-reduce's staging copy
from tessera.planner.costs import ModelCosts
from tessera.planner.layout import (
    Layout,
    MixedLayout,
    OpTimes,
    ReplicaSpec,
    SyncGroup,
    grad_sync_s,
    op_times,
    optimizer_s,
    recomputed_blocks,
)

INFEASIBLE = float("inf")  # the step time of a layout that does not fit


@dataclass(frozen=True)
class DeviceMemory:
    """Predicted peak bytes on one device of one replica class and stage."""

    replica: int
    stage: int
    device: str
    model_state: float
    activations: float
    buffers: float
    capacity: float

    @property
    def total(self) -> float:
        return self.model_state + self.activations + self.buffers

    @property
    def fits(self) -> bool:
        return self.total <= self.capacity


@dataclass(frozen=True)
class Estimate:
    """What the cost model predicts for one Layout."""

    step_s: float
    tokens_per_s: float
    memory: tuple[DeviceMemory, ...]
    pipeline_s: tuple[float, ...]  # per replica class
    sync_s: tuple[float, ...]  # per stage
    optimizer_s: float
    bottleneck: str
    breakdown: dict[str, float] = field(default_factory=dict)

    @property
    def fits(self) -> bool:
        return all(m.fits for m in self.memory)

    @property
    def over_memory(self) -> list[DeviceMemory]:
        return [m for m in self.memory if not m.fits]


def pipeline_s(times: OpTimes, microbatches: int, schedule: str = "1f1b") -> float:
    """Makespan of one replica's micro-batches through its stages (see the module docstring)."""
    m, pp = microbatches, len(times.forward)
    if schedule == "gpipe" or pp == 1:  # all forwards flow through, then all backwards; a link between
        moving = [times.moving_s(u) for u in range(len(times.transfer))]
        return (  # stages is a stage of its own there (its transfers' bytes go one after another)
            sum(times.forward) + sum(times.backward) + 2 * sum(times.transfer)
            + (m - 1) * (max((*times.forward, *moving)) + max((*times.backward, *moving)))
        )  # fmt: skip
    # 1f1b, per stage s, whichever limit is later; the slowest stage's is the makespan.
    # Busy: all m forwards and backwards, after waiting for the first backward (the round trip D
    # through every later stage) less the w − 1 warm-up forwards that fill that wait.
    # Flow: when all m fit in the w warm-up slots they leave s back to back, one per max(F, the
    # slowest later F + B). Else the first one's round trip T, then the tightest loop from s out
    # to a stage t and back: it holds k = t − s + 1 micro-batches (one per stage, as 1f1b
    # alternates), takes L_t = Σ_{s..t} (F + B) + 2 Σ transfers, and lets k micro-batches through
    # per turn, staggered by q = max(F + B, slowest later F + B); t = last is the full round trip.
    # The k micro-batches of a turn cross each boundary of the loop one sender's pass apart; where one's
    # bytes take longer than that pass they queue on the link (a slow link paces the loop, not one transfer).
    cost = [f + b for f, b in zip(times.forward, times.backward)]
    worst, before_f, before_b = 0.0, 0.0, 0.0
    for s in range(pp):
        f, b = times.forward[s], times.backward[s]
        later = sum(cost[s + 1 :]) + 2 * sum(times.transfer[s:])
        w = min(m, pp - s)
        busy = m * (f + b) + max(0.0, later - (w - 1) * f)
        slowest_later = max(cost[s + 1 :], default=0.0)
        if m <= w:  # every micro-batch leaves in warm-up, back to back, as fast as later stages take them
            flow = (m - 1) * max(f, slowest_later) + f + later + b
        else:
            q, turns = max(f + b, slowest_later), 0.0
            # k micro-batches sent a pass apart cross boundary u in transfer + (k − 1)·max(0, moving − pass):
            # each pays the latency in parallel, their bytes queue. Sums over the loop s..t, kept running.
            computing = sending = queueing = 0.0
            for t in range(s, pp):
                k = t - s + 1
                computing += cost[t]
                if t > s:
                    u = t - 1
                    sending += 2 * times.transfer[u]
                    moving = times.moving_s(u)
                    queueing += max(0.0, moving - times.forward[u]) + max(0.0, moving - times.backward[u + 1])
                loop = computing + sending + (k - 1) * queueing
                turns = max(turns, ((m - 1) // k) * max(loop, k * q) + ((m - 1) % k) * q)
            flow = f + later + b + turns
        worst = max(worst, before_f + max(busy, flow) + before_b)
        if s < pp - 1:
            before_f += f + times.transfer[s]
            before_b += b + times.transfer[s]
    return worst


def stage_finish_s(times: OpTimes, microbatches: int, schedule: str = "1f1b") -> list[float]:
    """When each stage of a replica finishes its last backward, from the replica's start."""
    end = pipeline_s(times, microbatches, schedule)
    finish, tail = [], 0.0
    for s in range(len(times.forward)):
        finish.append(end - tail)
        tail += times.backward[s] + (times.transfer[s] if s < len(times.transfer) else 0.0)
    return finish


def step_time(layout: Layout, costs: ModelCosts) -> tuple[float, list[float], list[float], float]:
    """(step seconds, pipeline seconds per replica class, sync seconds per stage, slowest optimizer step)."""
    times = [op_times(layout, costs, r) for r in layout.replicas]
    finish = [stage_finish_s(t, layout.microbatches, layout.schedule) for t in times]
    syncs = [grad_sync_s(layout, costs, s) for s in range(layout.pp)]
    opts = [max(optimizer_s(layout, costs, s, r.units[s]) for r in layout.replicas) for s in range(layout.pp)]
    step = max(max(f[s] for f in finish) + syncs[s] + opts[s] for s in range(layout.pp))
    return step, [pipeline_s(t, layout.microbatches, layout.schedule) for t in times], syncs, max(opts)


def device_memory(layout: Layout, costs: ModelCosts, replica: ReplicaSpec, stage: int) -> tuple[float, float, float]:
    """(model state, activations, buffers) bytes on one device of ``replica`` at ``stage``."""
    first, end = layout.stages[stage]
    local = costs.stage_params(first, end) / layout.tp
    dp, zero = layout.dp, layout.zero
    params = 4 * local / (dp if zero >= 3 else 1)
    grads = 4 * local / (dp if zero >= 2 else 1)
    optim = 8 * local / (dp if zero >= 1 else 1)
    if layout.offload:  # optimizer state lives on the host; ZeRO-3 offload keeps parameters and grads there too
        optim = 0.0
        if zero == 3:
            params = grads = 0.0
    b, m = replica.micro_batch, layout.microbatches
    held = m if layout.schedule == "gpipe" else min(m, layout.pp - stage)
    if layout.pp == 1:
        held = 1  # accumulation: one micro-batch's activations at a time
    blocks = end - first
    block_act = costs.parts["block"].activation_bytes * b * costs.tp_activation_share(layout.tp)
    if recomputed := recomputed_blocks(layout.recompute, blocks):  # they keep their input; one block's
        kept = recomputed * costs.boundary_bytes(b) + (blocks - recomputed) * block_act  # are rebuilt at once
        activations = held * kept + block_act
    else:
        activations = held * blocks * block_act
    activations += held * costs.edge_activation_bytes(first, end) * b
    if end == costs.n_layers:  # the loss: kept per micro-batch held, its gradients once
        activations += (held * costs.loss_saved_bytes + costs.loss_grad_bytes) * b
    if layout.grads_freed:  # the replicas engine: plain gradients, averaged in flat buckets after the backward
        buffers = min(4 * local, BUCKET_BYTES) if dp > 1 else 0.0
        # The bucket's flat copy is made once the activations are freed; with one micro-batch a step the
        # gradients too only grow as they are freed (zero_grad left none): the step's peak is the larger side.
        after = buffers + (grads if m == 1 else 0.0)
        return params + grads + optim, max(activations - after, 0.0), buffers
    if zero == 3:  # one block's parameters gathered and the next one prefetched; the root's kept gathered
        root = costs.stage_params(first, end) - blocks * costs.parts["block"].params  # from forward to backward
        buffers = 4 * (2 * costs.parts["block"].params + root) / layout.tp
    elif zero <= 1 and layout.pp == 1 and layout.tp == 1:
        buffers = 0.0  # DDP's buckets are the gradients themselves (gradient_as_bucket_view)
    else:
        buffers = min(4 * local, BUCKET_BYTES) if dp > 1 else 0.0
    return params + grads + optim, activations, buffers


def fits(layout: Layout, costs: ModelCosts) -> bool:
    """Whether every device of ``layout`` stays within its usable memory."""
    return all(
        sum(device_memory(layout, costs, replica, s)) <= unit.memory_bytes
        for replica in layout.replicas
        for s, unit in enumerate(replica.units)
    )


def estimate(layout: Layout | MixedLayout, costs: ModelCosts) -> Estimate:
    """Step time, throughput, memory per device and the bottleneck of ``layout`` (a Layout, or
    replicas of different depth: :func:`mixed_estimate`)."""
    if isinstance(layout, MixedLayout):
        return mixed_estimate(layout, costs)
    step, pipes, syncs, opt = step_time(layout, costs)
    memory = []
    for i, replica in enumerate(layout.replicas):
        for s, unit in enumerate(replica.units):
            state, act, buf = device_memory(layout, costs, replica, s)
            memory.append(DeviceMemory(i, s, unit.device, state, act, buf, unit.memory_bytes))
    tokens = layout.global_batch * costs.seq_len
    causes = breakdown(layout, costs, step, syncs, opt)
    return Estimate(
        step, tokens / step, tuple(memory), tuple(pipes), tuple(syncs), opt, bottleneck(layout, causes), causes
    )


def breakdown(layout: Layout, costs: ModelCosts, step: float, syncs: list[float], opt: float) -> dict[str, float]:
    """Seconds of the step by cause, on the critical replica's busiest stage."""
    worst = max(
        layout.replicas, key=lambda r: pipeline_s(op_times(layout, costs, r), layout.microbatches, layout.schedule)
    )
    times = op_times(layout, costs, worst)
    busiest = max(range(layout.pp), key=lambda s: times.forward[s] + times.backward[s])
    compute = layout.microbatches * (times.forward[busiest] + times.backward[busiest])
    sync = max(syncs)
    return {
        "compute": compute,
        "gradient sync": sync,
        "optimizer": opt,
        "pipeline bubble and transfers": max(step - compute - sync - opt, 0.0),
        "busiest stage": float(busiest),
    }


def bottleneck(layout: Layout, breakdown: dict[str, float]) -> str:
    """The largest share of the step, in words."""
    parts = {k: v for k, v in breakdown.items() if k != "busiest stage"}
    total = sum(parts.values()) or 1.0
    cause = max(parts, key=lambda k: parts[k])
    share = parts[cause] / total
    stage = int(breakdown["busiest stage"])
    if cause == "compute":
        where = f" on stage {stage}" if layout.pp > 1 else ""
        return f"compute{where} ({share:.0%} of the step)"
    if cause == "gradient sync":
        return f"gradient sync over the data-parallel link ({share:.0%} of the step)"
    if cause == "optimizer":
        return f"optimizer step{' on the host' if layout.offload else ''} ({share:.0%} of the step)"
    return f"pipeline bubble and stage transfers ({share:.0%} of the step)"


# ------------------------------------------------- replicas of different depth
def replica_sync_s(groups: tuple[SyncGroup, ...]) -> float:
    """Every fp32 gradient averaged among its holders (:func:`~tessera.planner.layout.sync_groups`): each
    group's all-reduce over its own slowest link, in flat buckets of ``BUCKET_BYTES`` one after the other,
    each paying the ring's latency. Every rank handles its groups in the runtime's order (sorted ranks), so a
    group starts once all its ranks are done with earlier ones; groups of disjoint ranks overlap."""
    free: dict[int, float] = {}
    for group in groups:
        grads = 4 * group.params
        start = max(free.get(rank, 0.0) for rank in group.ranks)
        end = start + group.link.all_reduce_s(grads, len(group.ranks), calls=math.ceil(grads / BUCKET_BYTES))
        free.update(dict.fromkeys(group.ranks, end))
    return max(free.values(), default=0.0)


def replica_sync_floor(costs: ModelCosts, link: Link, replicas: int, most_devices: int) -> float:
    """No split of the layers makes the sync of ``replicas`` replicas shorter, when every group's slowest link
    is ``link`` (the search's: each replica in one node) and the largest replica has ``most_devices``: one of
    its devices holds ≥ 1/most_devices of the gradients and reduces all of them, one group after the other."""
    return link.all_reduce_s(4 * costs.stage_params(0, costs.n_layers) / most_devices, replicas)


def replica_optimizer_s(view: Layout, costs: ModelCosts) -> float:
    """The slowest optimizer step among the stages of a one-replica Layout."""
    return max(optimizer_s(view, costs, s, u) for s, u in enumerate(view.replicas[0].units))


def mixed_estimate(layout: MixedLayout, costs: ModelCosts) -> Estimate:
    """The closed-form estimate of replicas of different depth (:class:`MixedLayout`): each replica
    costed as a one-replica Layout, step = max(pipeline) + sync of every gradient + max(optimizer)."""
    pipes, opts, memory = [], [], []
    for i, part in enumerate(layout.parts):
        spec = part.replicas[0]
        pipes.append(pipeline_s(op_times(part, costs, spec), part.microbatches, part.schedule))
        opts.append(replica_optimizer_s(part, costs))
        for s, unit in enumerate(spec.units):
            state, act, buf = device_memory(part, costs, spec, s)
            memory.append(DeviceMemory(i, s, unit.device, state, act, buf, unit.memory_bytes))
    sync = replica_sync_s(layout.sync_groups)
    step = max(pipes) + sync + max(opts)
    part = layout.parts[max(range(len(layout.parts)), key=lambda i: pipes[i])]  # the critical replica
    causes = breakdown(part, costs, step, [sync], max(opts))
    tokens = layout.global_batch * costs.seq_len
    return Estimate(
        step, tokens / step, tuple(memory), tuple(pipes), (sync,), max(opts), bottleneck(part, causes), causes
    )
