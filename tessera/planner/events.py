"""The simulator's event engine: tasks on in-order streams (a device's compute, a communication stream)
that wait for the tasks they depend on, and flows that share the bandwidth of the link channels they
cross evenly (two transfers that meet on a link both slow down; a shaped link's burst passes at once after
it idled). :mod:`tessera.planner.simulate` builds one step of a layout out of these tasks."""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass


@dataclass
class Task:
    streams: tuple  # streams it occupies, in the order they were given their tasks
    deps: list[int]
    seconds: float = 0.0  # compute
    volume: float = 0.0  # bytes to move (a flow)
    latency: float = 0.0  # seconds before the flow moves bytes
    channels: tuple = ()
    label: tuple | None = None  # (replica, stage, kind, microbatch) for the timeline
    comm: str = ""  # kind of transfer, for comm_s
    start: float = -1.0
    end: float = -1.0


class Engine:
    """Tasks on in-order streams with dependencies; flows share their channels' bandwidth evenly."""

    def __init__(self) -> None:
        self.tasks: list[Task] = []
        self.queues: dict[object, list[int]] = {}
        self.bandwidth: dict[object, float] = {}  # bytes per second of each channel
        self.burst: dict[object, float] = {}  # bytes a channel passes at once after idling

    def channel(self, key: object, bandwidth_gbs: float, burst_bytes: float = 0.0) -> object:
        self.bandwidth.setdefault(key, bandwidth_gbs * 1e9)
        self.burst.setdefault(key, burst_bytes)
        return key

    def add(self, streams: tuple = (), deps: list[int] | tuple = (), **kw: object) -> int:
        index = len(self.tasks)
        self.tasks.append(Task(tuple(streams), [d for d in deps if d is not None], **kw))  # type: ignore[arg-type]
        for s in streams:
            self.queues.setdefault(s, []).append(index)
        return index

    def run(self) -> tuple[float, dict[str, float]]:
        """Replay every task; returns (when the last one ends, seconds each kind of transfer moved bytes).

        Flows are updated incrementally: adding or removing one re-rates only the flows that share
        a channel with it, so a 4,096-device plan's thousands of transfers replay in seconds."""
        tasks = self.tasks
        waiting = [len(t.deps) for t in tasks]
        dependents: list[list[int]] = [[] for _ in tasks]
        for i, t in enumerate(tasks):
            for d in t.deps:
                dependents[d].append(i)
        head = {s: 0 for s in self.queues}
        # (time, kind, task, version): kind 0 compute ends, 1 a flow starts moving, 2 a flow ends
        heap: list[tuple[float, int, int, int]] = []
        flows: dict[int, list[float]] = {}  # task -> [bytes left at t0, rate, t0, version]
        on_channel: dict[object, set[int]] = {}
        idle_since: dict[object, float] = {}  # when each channel last emptied (never used: its bucket is full)
        in_flight: dict[str, list[float]] = {}  # kind of transfer -> [flows moving, since when]
        busy: dict[str, float] = {}
        now, finished = 0.0, 0

        def ready(i: int) -> bool:
            t = tasks[i]
            return t.start < 0 and waiting[i] == 0 and all(self.queues[s][head[s]] == i for s in t.streams)

        def start(i: int) -> None:
            t = tasks[i]
            t.start = now
            if t.volume > 0 or t.latency > 0:
                heapq.heappush(heap, (now + t.latency, 1, i, 0))
            else:
                heapq.heappush(heap, (now + t.seconds, 0, i, 0))

        def finish(i: int) -> list[int]:
            nonlocal finished
            t = tasks[i]
            t.end = now
            finished += 1
            candidates = []
            for s in t.streams:
                head[s] += 1
                if head[s] < len(self.queues[s]):
                    candidates.append(self.queues[s][head[s]])
            for j in dependents[i]:
                waiting[j] -= 1
                candidates.append(j)
            return candidates

        def rerate(affected: set[int]) -> None:
            for j in affected:
                f = flows[j]
                if f[1] < math.inf:  # bytes moved at the old rate (a new flow has none yet)
                    f[0] -= f[1] * (now - f[2])
                f[1] = min((self.bandwidth[c] / len(on_channel[c]) for c in tasks[j].channels), default=math.inf)
                f[2], f[3] = now, f[3] + 1
                heapq.heappush(heap, (now + max(f[0], 0.0) / f[1], 2, j, int(f[3])))

        def sharing(i: int) -> set[int]:
            return {j for c in tasks[i].channels for j in on_channel[c]}

        def count(kind: str, delta: int) -> None:  # wall time with this kind's bytes in flight
            state = in_flight.setdefault(kind, [0, now])
            if state[0] == 0 and delta > 0:
                state[1] = now
            state[0] += delta
            if state[0] == 0:
                busy[kind] = busy.get(kind, 0.0) + now - state[1]

        for i in range(len(tasks)):
            if ready(i):
                start(i)
        while heap:
            now, kind, i, version = heapq.heappop(heap)
            if kind == 2 and (i not in flows or flows[i][3] != version):
                continue  # superseded by a re-rate
            if kind == 1 and tasks[i].volume > 0:
                slowest = min(tasks[i].channels, key=lambda c: self.bandwidth[c], default=None)
                credit = 0.0  # the slowest channel's bucket, refilled while it idled
                if slowest is not None and not on_channel.get(slowest):
                    idled = now - idle_since.get(slowest, -math.inf)
                    credit = min(self.burst[slowest], idled * self.bandwidth[slowest])
                for c in tasks[i].channels:
                    on_channel.setdefault(c, set()).add(i)
                flows[i] = [max(tasks[i].volume - credit, 0.0), math.inf, now, 0]
                count(tasks[i].comm, 1)
                rerate(sharing(i))
                continue
            if kind == 2:
                del flows[i]
                for c in tasks[i].channels:
                    on_channel[c].discard(i)
                    if not on_channel[c]:
                        idle_since[c] = now
                count(tasks[i].comm, -1)
                rerate(sharing(i))
            candidates = finish(i)
            for j in candidates:
                if ready(j):
                    start(j)
        if finished < len(tasks):
            stuck = [i for i, t in enumerate(tasks) if t.start < 0][:3]
            raise RuntimeError(f"the simulator deadlocked at tasks {stuck} (a bug: please report it)")
        return max((t.end for t in tasks), default=0.0), busy
