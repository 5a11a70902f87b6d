"""The simulator: an event-level replay of one training step, written apart from the cost model.

It shares only the *measured inputs* with :mod:`~tessera.planner.costmodel`: each part's
forward seconds (:meth:`ModelCosts.forward_s`), parameter counts, the backward ratio, each
device's memory speed and each link's bandwidth and latency. Everything else is its own model
of what the runtime does, op by op:

- **Compute** part by part (embedding, every block, head) on each rank's compute stream, in the
  schedule's order (gpipe: every forward then every backward; 1f1b: ``pp − s`` warm-up
  forwards, then one backward and one forward in turn). Tensor parallelism splits each part's
  compute over ``tp`` and blocks on two all-reduces of the hidden states per block and pass.
- **Pipeline p2p**: every micro-batch's activations (and their gradient, back) are one transfer
  on the link between the two stages' nodes; the receiver waits for it.
- **DDP** (ZeRO-0/1 without a pipeline): gradients are packed into buckets of
  ``BUCKET_BYTES`` in reverse parameter order; a bucket's all-reduce starts, on a
  communication stream, as soon as the last micro-batch's backward has produced all its
  gradients, so it overlaps the rest of the backward. ZeRO-1 then broadcasts every parameter
  piece from its owner after the optimizer step, one collective per tensor: on gloo each send of
  its binomial tree is a flow of its own, owner after owner; elsewhere one pipelined chain.
- **FSDP** (ZeRO-2/3) unit by unit (each block, and the root holding embedding and head): the
  forward gathers each unit (in the compute precision) before its compute with one unit
  prefetched; ZeRO-3 gathers each block again in backward (the root stays gathered); the last
  micro-batch reduce-scatters each unit right after its backward, on a stream of its own, so
  gathers and reductions share the link.
  Where a link has no streams (gloo: CPU tensors, :attr:`Link.has_streams`) FSDP2 issues each of
  them on the compute thread and waits: no prefetch, no overlap.
- **Under a pipeline** the schedule runs backward itself: replicated gradients are averaged in
  one flat all-reduce after the stage's last backward; FSDP gathers a stage once before its
  first forward (ZeRO-3: again before its first backward) and reduce-scatters it after its last.
- **Links are shared**: every transfer is a flow on the directed links it crosses (a ring
  collective crosses one hop per member); flows on one link split its bandwidth evenly, so two
  transfers that meet on a link both slow down. Latency is paid per ring step before the flow
  moves bytes. A link with a measured burst (``Link.burst_bytes``: a token-bucket shaper's depth)
  refills it at its bandwidth while no flow crosses it; a flow that starts on it idle passes that
  many of its bytes at once (on its slowest link). A layout built from a Plan knows each rank's
  node, so flows meet where they really share a node pair; the search's compact layouts (alike
  replicas folded into a count) get one link per stage's data-parallel group and one per stage
  boundary.
- **What a transfer costs compute**: a data-parallel collective takes ``1 − comm_overlap`` of its
  bytes' time from each member's compute stream where it is issued (``DeviceType.comm_overlap``:
  1 by default, for copy engines and NCCL; measured by a live profile: 0.73–0.92 for gloo on the
  testbed's quota-held CPUs).
- **Optimizer**: 16 bytes per local parameter at the device's memory speed (on the host, with
  the copies both ways, when offloaded), after the stage's gradients are in.

The events it returns draw the timeline in ``tessera plan``'s picture; ``comm_s`` is how long
each kind of transfer (data parallel, pipeline, tensor parallel) was moving bytes. The engine that runs
the tasks is :mod:`tessera.planner.events`; this module stays one piece (a little over 450 lines, a third
of them this description) so that one step's tasks read top to bottom, in the order the runtime runs them.

Example:
    >>> sim = simulate(layout, costs)
    >>> sim.step_s, sim.events[:3]
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from tessera.parallel.data_parallel import BUCKET_BYTES
from tessera.planner.costs import ModelCosts
from tessera.planner.events import Engine
from tessera.planner.layout import (
    HOST_BANDWIDTH_GBS,
    HOST_LINK,
    MAX_TREE_RANKS,
    Layout,
    MixedLayout,
    gloo_broadcast_tree,
    recomputes,
)

GRAD_BYTES = 4  # fp32 gradients and master weights, whatever the compute precision
BROADCAST_CHUNKS = 4  # a ZeRO-1 owner's pieces, as the simulator moves them down gloo's tree


@dataclass(frozen=True)
class Event:
    """One interval of work on the devices of one replica class at one stage."""

    replica: int
    stage: int
    kind: str  # "forward", "backward", "sync", "optimizer"
    microbatch: int
    start: float
    end: float


@dataclass(frozen=True)
class Simulation:
    step_s: float
    events: tuple[Event, ...]
    comm_s: dict[str, float] = field(default_factory=dict)  # seconds each kind of transfer was moving bytes


# ------------------------------------------------------------------- one step
@dataclass
class _Part:
    name: str  # "first", "block", "last"
    params: int
    unit: int  # FSDP unit: 0 the root (first and last), 1.. the blocks


def _parts(costs: ModelCosts, first: int, end: int) -> list[_Part]:
    """A stage's parts in forward order."""
    parts = [_Part("first", costs.parts["first"].params, 0)] if first == 0 else []
    parts += [_Part("block", costs.parts["block"].params, 1 + k) for k in range(end - first)]
    if end == costs.n_layers:
        shared = costs.shared_params if first == 0 else 0  # a tied head is the embedding: one copy
        parts.append(_Part("last", costs.parts["last"].params - shared, 0))
    return parts


def schedule_order(schedule: str, pp: int, stage: int, microbatches: int) -> list[tuple[str, int]]:
    """The order in which one stage runs its forwards ("F", i) and backwards ("B", i)."""
    m = microbatches
    if schedule == "gpipe" or pp == 1:
        return [("F", i) for i in range(m)] + [("B", i) for i in range(m)]
    warmup = min(m, pp - stage)
    order = [("F", i) for i in range(warmup)]
    next_f, next_b = warmup, 0
    while next_b < m:
        order.append(("B", next_b))
        next_b += 1
        if next_f < m:
            order.append(("F", next_f))
            next_f += 1
    return order


class _Step:
    """Adds one step of a Layout's tasks to an engine (``offset``: index of its first replica class)."""

    def __init__(self, engine: Engine, layout: Layout, costs: ModelCosts, offset: int = 0) -> None:
        self.e, self.layout, self.costs, self.offset = engine, layout, costs, offset
        self.parts = [_parts(costs, a, b) for a, b in layout.stages]
        self.fsdp = layout.zero >= 2 and layout.dp > 1
        self.shared: dict[tuple, int] = {}  # one collective, joined by every replica class
        self.joined: set[tuple] = set()  # (key, replica class) of the blocking FSDP collectives joined so far
        self.last_backward: dict[tuple[int, int], int] = {}  # (replica class, stage) -> task
        self.grads_in: dict[int, list[int]] = {}  # stage -> collectives its optimizer waits for

    def stream(self, name: str, r: int, s: int) -> tuple:
        return (name, r + self.offset, s)

    # ------------------------------------------------------------- transfers
    def collective(self, key: tuple, kind: str, s: int, nbytes: float, deps: list, stream: str = "comm",
                   calls: int = 1, member: int | None = None) -> int:  # fmt: skip
        """A collective over stage ``s``'s data-parallel group: "all_reduce", "all_gather", "reduce_scatter"
        or "broadcast" (``calls`` of them, one latency each). Every replica class joins it under one ``key``;
        it starts once every member's ``stream`` reaches it and every member's ``deps`` are done.
        ``member``: the replica class joining here, whose compute loses its share (see :meth:`_stall`)."""
        if key in self.shared:
            task = self.shared[key]
            self.e.tasks[task].deps.extend(d for d in deps if d is not None)
            if member is not None:
                self._stall(member, s, task, deps)
            return task
        layout, n = self.layout, self.layout.dp
        channels, hop = self._ring(s)
        # Ring steps; each moves 1/n of the buffer and pays a hop's latency (gloo reduce-scatters with a whole
        # all-reduce). A broadcast is one pipelined chain moving (n − 1)/n.
        steps = {"all_reduce": 2 * (n - 1), "all_gather": n - 1, "broadcast": 1,
                 "reduce_scatter": layout.dp_links[s].reduce_scatter_steps(n)}  # fmt: skip
        share = (n - 1) / n if kind == "broadcast" else steps[kind] / n
        streams = tuple(self.stream(stream, r, s) for r in range(len(layout.replicas)))
        task = self.e.add(
            streams, deps, volume=share * nbytes, latency=calls * steps[kind] * hop, channels=channels,
            comm="data parallel",
        )  # fmt: skip
        self.shared[key] = task
        if member is not None:
            self._stall(member, s, task, deps)
        return task

    def _fsdp_collective(self, key: tuple, kind: str, s: int, nbytes: float, deps: list, stream: str, r: int) -> int:
        """An FSDP gather or reduce-scatter on ``stream``, beside the compute. Where the link has no streams it is
        issued once replica class ``r``'s compute stream reaches it, and that stream waits for it to end."""
        if self.layout.dp_links[s].has_streams:
            return self.collective(key, kind, s, nbytes, deps, stream, member=r)
        if (key, r) in self.joined:  # a stage's gather serves every micro-batch: issued once
            return self.shared[key]
        self.joined.add((key, r))
        compute = self.stream("compute", r, s)
        issued = self.e.queues.get(compute, [])[-1:]  # the last task the compute thread ran before it
        task = self.collective(key, kind, s, nbytes, [*issued, *deps], stream)
        self.e.add((compute,), [task], seconds=0.0)
        return task

    def _stall(self, r: int, s: int, task: int, deps: list) -> None:
        """What a collective costs replica class ``r``'s compute at stage ``s``: ``1 − comm_overlap`` of the
        time its bytes take on the slowest channel alone, in the compute stream where the collective is
        issued. A device whose copy engines move the bytes (1.0) loses nothing; one whose copies and
        reductions take its compute's processor time loses what the live profile measured."""
        lost = 1.0 - self.layout.replicas[r].units[s].comm_overlap
        t = self.e.tasks[task]
        if lost <= 0 or t.volume <= 0:
            return
        seconds = lost * t.volume / min(self.e.bandwidth[c] for c in t.channels)
        self.e.add((self.stream("compute", r, s),), deps, seconds=seconds)

    def _ring(self, s: int) -> tuple[tuple, float]:
        """Channels a ring over stage ``s``'s data-parallel group crosses, and its slowest hop's latency."""
        layout = self.layout
        if layout.nodes and all(spec.count == 1 for spec in layout.replicas):
            members = [layout.nodes[r][s] for r in range(len(layout.replicas))]
            hops = list(zip(members, members[1:] + members[:1]))
            links = [layout.link_between(a, b) for a, b in hops]
            channels = tuple(self.e.channel(hop, k.bandwidth_gbs, k.burst_bytes) for hop, k in zip(hops, links))
            return channels, max(link.latency_us for link in links) * 1e-6
        link = layout.dp_links[s]
        return (self.e.channel(("dp", self.offset, s), link.bandwidth_gbs, link.burst_bytes),), link.latency_us * 1e-6

    def _tp_all_reduce(self, r: int, s: int, after: int) -> int:
        """One blocking all-reduce of the hidden states inside the tensor-parallel group."""
        layout, spec = self.layout, self.layout.replicas[r]
        n, link = layout.tp, spec.units[s].tp_link
        channel = self.e.channel(("tp", r + self.offset, s), link.bandwidth_gbs, link.burst_bytes)
        volume = 2 * (n - 1) / n * self.costs.boundary_bytes(spec.micro_batch)
        return self.e.add(
            (self.stream("compute", r, s),), [after], volume=volume,
            latency=2 * (n - 1) * link.latency_us * 1e-6, channels=(channel,), comm="tensor parallel",
        )  # fmt: skip

    def _p2p(self, r: int, s: int, forward: bool, after: int) -> int:
        """Activations from stage s to s + 1 (forward), or their gradient from s + 1 back to s."""
        layout, spec = self.layout, self.layout.replicas[r]
        link = spec.p2p[s]
        if layout.nodes and spec.count == 1:
            a, b = layout.nodes[r][s], layout.nodes[r][s + 1]
            key: tuple = (a, b) if forward else (b, a)
            link = layout.link_between(a, b)
        else:
            key = ("p2p", r + self.offset, s, forward)
        return self.e.add(
            (), [after], volume=self.costs.boundary_bytes(spec.micro_batch), latency=link.latency_us * 1e-6,
            channels=(self.e.channel(key, link.bandwidth_gbs, link.burst_bytes),), comm="pipeline",
        )  # fmt: skip

    def _unit_bytes(self, s: int, unit: int, gather: bool = False) -> float:
        """Bytes of one FSDP unit's gradients (fp32), or of its parameters as gathered (the compute dtype)."""
        per_param = self.costs.act_bytes if gather else GRAD_BYTES
        return per_param * sum(p.params for p in self.parts[s] if p.unit == unit) / self.layout.tp

    # ---------------------------------------------------------------- passes
    def _pass(self, r: int, s: int, mb: int, forward: bool, after: list) -> int:
        """One micro-batch's forward or backward through stage s of replica class r; returns its last task."""
        layout, spec = self.layout, self.layout.replicas[r]
        peak = spec.units[s].peak_tflops
        parts = self.parts[s] if forward else self.parts[s][::-1]
        per_unit_gather = self.fsdp and layout.pp == 1 and (forward or layout.zero == 3)
        reduce_now = layout.dp > 1 and layout.pp == 1 and not forward and mb == layout.microbatches - 1
        ratio = 1.0 if forward else self.costs.backward_ratio
        computes: list[int] = []
        last = None
        bucket = {"bytes": 0.0, "deps": [], "index": 0}
        gathered: dict[int, int] = {}  # unit -> its gather in this pass (the root serves embedding and head)
        in_order = [p.name == "block" for p in self.parts[s]]  # each block's index in the stage, in pass order
        block_index = [sum(in_order[:i]) for i in range(len(in_order))]
        block_index = block_index if forward else block_index[::-1]
        for k, part in enumerate(parts):
            deps = list(after) if k == 0 else [last]
            if per_unit_gather and (forward or part.unit != 0):  # the root stays gathered for the backward
                if part.unit not in gathered:
                    # one unit prefetched: unit k's gather may start once part k − 1 computes (k − 2 is done)
                    prefetch = [computes[k - 2]] if k >= 2 else list(after)
                    key = ("gather", s, part.unit, forward, mb)
                    size = self._unit_bytes(s, part.unit, gather=True)
                    gathered[part.unit] = self._fsdp_collective(key, "all_gather", s, size, prefetch, "gather", r)
                deps.append(gathered[part.unit])
            seconds = ratio * self.costs.forward_s(part.name, spec.micro_batch, peak) / layout.tp
            if not forward and part.name == "block" and recomputes(layout.recompute, block_index[k]):
                seconds += self.costs.forward_s(part.name, spec.micro_batch, peak) / layout.tp
            seconds += self._wrappers_s(part, k == 0, peak, spec.micro_batch)
            computes.append(self.e.add((self.stream("compute", r, s),), deps, seconds=seconds))
            last = computes[-1]
            if layout.tp > 1 and part.name == "block":
                for _ in range(2):
                    last = self._tp_all_reduce(r, s, last)
            if reduce_now:
                self._reduce(r, s, part, last, bucket, is_last=k == len(parts) - 1)
        label = (r + self.offset, s, "forward" if forward else "backward", mb)
        self.e.tasks[computes[0]].label = (*label, "start")
        self.e.tasks[last].label = (*label, "end")  # type: ignore[index]
        return last  # type: ignore[return-value]

    def _wrappers_s(self, part: _Part, first_in_pass: bool, peak: float, samples: int) -> float:
        """What FSDP's hooks (per unit: each block, and the root once per pass) and tensor parallelism
        (per block, beyond compute and link all-reduces) add to one part's pass, as the live profile
        measured them, scaled by speed."""
        layout, costs = self.layout, self.costs
        seconds = 0.0
        if layout.zero >= 2 and (part.name == "block" or first_in_pass):
            seconds += costs.fsdp_unit_s * ((part.name == "block") + first_in_pass)
        if layout.tp > 1 and part.name == "block":
            seconds += costs.tp_block_at(samples)
        return seconds * costs.ref_tflops / peak

    def _reduce(self, r: int, s: int, part: _Part, done: int, bucket: dict, is_last: bool) -> None:
        """The last micro-batch's backward has just produced ``part``'s gradients (no pipeline)."""
        layout = self.layout
        if self.fsdp:
            if part.name == "last":
                return  # the root unit's gradients are complete after the embedding's backward
            key = ("reduce", s, part.unit)
            task = self._fsdp_collective(key, "reduce_scatter", s, self._unit_bytes(s, part.unit), [done], "reduce", r)
        else:
            # DDP buckets in reverse parameter order (tensor parallel: replicate's one unit per block)
            size = GRAD_BYTES * part.params / layout.tp
            bucket["bytes"] += size
            bucket["deps"].append(done)
            full = bucket["bytes"] >= BUCKET_BYTES or (layout.tp > 1 and part.name == "block")
            if not (full or is_last):
                return
            key = ("bucket", s, bucket["index"])
            task = self.collective(key, "all_reduce", s, bucket["bytes"], bucket["deps"], member=r)
            bucket.update(bytes=0.0, deps=[], index=bucket["index"] + 1)
        if r == 0:
            self.grads_in.setdefault(s, []).append(task)

    def passes(self) -> None:
        """Every replica class's forwards and backwards in schedule order, with the pipeline's transfers."""
        layout = self.layout
        pp, m = layout.pp, layout.microbatches
        for r in range(len(layout.replicas)):
            orders = [schedule_order(layout.schedule, pp, s, m) for s in range(pp)]
            done: dict[tuple[str, int, int], int] = {}
            cursor = [0] * pp
            while any(cursor[s] < len(orders[s]) for s in range(pp)):
                progressed = False
                for s in range(pp):
                    while cursor[s] < len(orders[s]):
                        kind, i = orders[s][cursor[s]]
                        if kind == "F":
                            need = ("F", s - 1, i) if s > 0 else None
                        else:
                            need = ("B", s + 1, i) if s < pp - 1 else ("F", s, i)
                        if need is not None and need not in done:
                            break  # waits for a neighbour's op, emitted later
                        after: list = []
                        if need is not None:
                            if need[1] == s:
                                after.append(done[need])
                            else:
                                after.append(self._p2p(r, min(s, need[1]), kind == "F", done[need]))
                        if self.fsdp and pp > 1:
                            phase = "F" if kind == "F" or layout.zero == 2 else "B"
                            params = self.costs.act_bytes * sum(p.params for p in self.parts[s]) / layout.tp
                            key = ("stage gather", s, phase)
                            after.append(self._fsdp_collective(key, "all_gather", s, params, [], "gather", r))
                        done[(kind, s, i)] = self._pass(r, s, i, kind == "F", after)
                        cursor[s] += 1
                        progressed = True
                if not progressed:
                    raise RuntimeError(f"schedule {layout.schedule!r} deadlocks in the simulator (a bug: report it)")
            for s in range(pp):
                self.last_backward[(r, s)] = done[("B", s, m - 1)]
        if pp > 1 and layout.dp > 1:  # the schedule ran backward: one flat reduction per stage after it
            for s in range(pp):
                grads = GRAD_BYTES * sum(p.params for p in self.parts[s]) / layout.tp
                kind = "reduce_scatter" if self.fsdp else "all_reduce"
                deps = [self.last_backward[(r, s)] for r in range(len(layout.replicas))]
                for r in range(len(layout.replicas)):
                    sync = self.collective(("stage sync", s), kind, s, grads, [deps[r]], member=r)
                self.grads_in[s] = [sync]

    def optimizer(self, extra: list[int] | None = None) -> None:
        """Each device's step once its stage's gradients are in; ZeRO-1 owners then broadcast their pieces."""
        layout = self.layout
        for s in range(layout.pp):
            params = sum(p.params for p in self.parts[s]) / layout.tp
            local = params / (layout.dp if layout.zero >= 1 else 1)
            steps = []
            for r, spec in enumerate(layout.replicas):
                unit = spec.units[s]
                if layout.offload:
                    host = unit.host_bandwidth_gbs or HOST_BANDWIDTH_GBS
                    copy = HOST_LINK.latency_us * 1e-6 + GRAD_BYTES * local / (HOST_LINK.bandwidth_gbs * 1e9)
                    seconds = 2 * copy + 16 * local / (host * 1e9)
                else:
                    seconds = 16 * local / (unit.bandwidth_gbs * 1e9)
                deps = [self.last_backward[(r, s)], *self.grads_in.get(s, []), *(extra or [])]
                label = (r + self.offset, s, "optimizer", -1)
                steps.append(self.e.add((self.stream("compute", r, s),), deps, seconds=seconds, label=label))
            if layout.zero == 1 and layout.dp > 1:
                tensors = self.costs.stage_tensors(*layout.stages[s])
                if layout.dp_links[s].backend == "gloo" and len(layout.dp_groups) > s and layout.dp <= MAX_TREE_RANKS:
                    self._tree_broadcasts(s, GRAD_BYTES * params, steps, tensors)
                    continue
                for r, step in enumerate(steps):
                    self.collective(("broadcast", s), "broadcast", s, GRAD_BYTES * params, [step], calls=tensors,
                                    member=r)  # fmt: skip

    def _tree_broadcasts(self, s: int, nbytes: float, steps: list[int], tensors: int) -> None:
        """gloo's ZeRO-1 gather, send by send: the owners in turn, each broadcasting its 1/dp of ``nbytes`` down
        gloo's binomial tree in ``BROADCAST_CHUNKS`` chunks (its pieces are many broadcasts), so a rank that
        forwards sends one chunk while the next arrives. Every send is a flow on its directed node pair."""
        layout, n = self.layout, self.layout.dp
        members, chunks = layout.dp_groups[s], min(BROADCAST_CHUNKS, max(1, tensors // n))
        calls = max(1, tensors // n) / chunks  # broadcasts per chunk: one latency each
        before = list(steps)  # a broadcast is a collective: every owner has stepped
        for root in range(n):
            sent = []
            for _ in range(chunks):
                arrived: dict[int, int] = {}
                for src, dst in gloo_broadcast_tree(n, root):
                    hop = (members[src], members[dst])
                    link = layout.link_between(*hop)
                    task = self.e.add(
                        (("broadcast", self.offset, s, src, dst),), [*before, arrived.get(src)],
                        volume=nbytes / n / chunks, latency=calls * link.latency_us * 1e-6,
                        channels=(self.e.channel(hop, link.bandwidth_gbs, link.burst_bytes),), comm="data parallel",
                    )  # fmt: skip
                    arrived[dst] = task
                    sent.append(task)
            before = sent


# ------------------------------------------------------------------ the result
def _events(engine: Engine, steps: list[_Step]) -> list[Event]:
    """Forward/backward spans from their first and last task, the optimizer, and each stage's sync span."""
    events, opened = [], {}
    for t in engine.tasks:
        if t.label is None:
            continue
        if t.label[2] == "optimizer":
            events.append(Event(t.label[0], t.label[1], "optimizer", -1, t.start, t.end))
        elif t.label[4] == "start":
            opened[t.label[:4]] = t.start
        if len(t.label) == 5 and t.label[4] == "end":
            key = t.label[:4]
            events.append(Event(key[0], key[1], key[2], key[3], opened.get(key, t.start), t.end))
    for step in steps:
        for s, tasks in step.grads_in.items():
            ts = [engine.tasks[i] for i in tasks]
            for r in range(len(step.layout.replicas)):
                events.append(Event(r + step.offset, s, "sync", -1, min(t.start for t in ts), max(t.end for t in ts)))
    return events


def simulate(layout: Layout | MixedLayout, costs: ModelCosts) -> Simulation:
    """Replay one step of ``layout`` event by event (see the module docstring)."""
    if isinstance(layout, MixedLayout):
        return _simulate_mixed(layout, costs)
    engine = Engine()
    step = _Step(engine, layout, costs)
    step.passes()
    step.optimizer()
    end, busy = engine.run()
    return Simulation(end, tuple(_events(engine, [step])), busy)


def _simulate_mixed(layout: MixedLayout, costs: ModelCosts) -> Simulation:
    """Replicas of different depth: each one's pipeline; then (as the runtime's LayerSync does) each group of
    gradient holders averaged in flat buckets over its own links, every rank taking its groups in order; then
    each replica's step once its groups are done."""
    engine = Engine()
    steps = []
    for index, part in enumerate(layout.parts):
        step = _Step(engine, replace(part, dp=1), costs, offset=index)  # its own sync is the replicas' one below
        step.passes()
        steps.append(step)
    done: dict[int, int] = {}  # rank -> its last sync task
    synced: dict[int, list[int]] = {}  # replica -> the sync tasks of its groups
    for group in layout.sync_groups:
        link, n = group.link, len(group.ranks)
        channel = engine.channel(("replicas", group.nodes), link.bandwidth_gbs, link.burst_bytes)  # by node set
        previous = [steps[i].last_backward[(0, s)] for i, s, _ in group.holders]
        previous += [done[rank] for rank in group.ranks if rank in done]
        left = GRAD_BYTES * group.params
        while left > 0:
            chunk = min(left, BUCKET_BYTES)
            left -= chunk
            previous = [
                engine.add(
                    tuple(("sync", *holder) for holder in group.holders), previous, volume=2 * (n - 1) / n * chunk,
                    latency=2 * (n - 1) * link.latency_us * 1e-6, channels=(channel,), comm="data parallel",
                )
            ]  # fmt: skip
        done.update(dict.fromkeys(group.ranks, previous[0]))
        for i in {i for i, _, _ in group.holders}:
            synced.setdefault(i, []).append(previous[0])
    for index, step in enumerate(steps):
        step.optimizer(extra=synced.get(index, []))
    end, busy = engine.run()
    return Simulation(end, tuple(_events(engine, steps)), busy)
