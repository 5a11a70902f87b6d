"""The simulator: an event-level replay of one training step of a :class:`Layout`.

Written apart from the closed-form cost model on purpose: it runs each stage's operations in
the order the schedule gives them (gpipe: every forward then every backward; 1f1b: ``pp − s``
warm-up forwards, then one backward and one forward in turn, then the remaining backwards),
starting each as soon as its stage is free and its input has arrived, then the per-stage
gradient synchronisation and optimizer step. Per-operation durations come from
:func:`~tessera.planner.layout.op_times`, the same inputs the cost model reads, so the two
differ only where a closed form cannot follow the schedule. The events it returns draw the
timeline in ``tessera plan``'s picture.

Example:
    >>> sim = simulate(layout, costs)
    >>> sim.step_s, sim.events[:3]
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from tessera.planner.costmodel import replica_sync_s
from tessera.planner.costs import ModelCosts
from tessera.planner.layout import Layout, MixedLayout, grad_sync_s, op_times, optimizer_s


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


def _replay(layout: Layout, costs: ModelCosts, index: int) -> list[Event]:
    """Events of one replica's forwards and backwards, run in schedule order."""
    times = op_times(layout, costs, layout.replicas[index])
    pp, m = layout.pp, layout.microbatches
    orders = [schedule_order(layout.schedule, pp, s, m) for s in range(pp)]
    done: dict[tuple[str, int, int], float] = {}  # (kind, stage, microbatch) -> end time
    cursor, free = [0] * pp, [0.0] * pp
    events: list[Event] = []
    while any(cursor[s] < len(orders[s]) for s in range(pp)):
        progressed = False
        for s in range(pp):
            while cursor[s] < len(orders[s]):
                kind, i = orders[s][cursor[s]]
                if kind == "F":
                    dep = ("F", s - 1, i) if s > 0 else None
                    lag = times.transfer[s - 1] if s > 0 else 0.0
                    duration = times.forward[s]
                else:
                    dep = ("B", s + 1, i) if s < pp - 1 else ("F", s, i)
                    lag = times.transfer[s] if s < pp - 1 else 0.0
                    duration = times.backward[s]
                if dep is not None and dep not in done:
                    break  # waits for another stage
                start = max(free[s], done[dep] + lag if dep is not None else 0.0)
                free[s] = done[(kind, s, i)] = start + duration
                events.append(Event(index, s, "forward" if kind == "F" else "backward", i, start, free[s]))
                cursor[s] += 1
                progressed = True
        if not progressed:
            raise RuntimeError(f"schedule {layout.schedule!r} deadlocks in the simulator (a bug: please report it)")
    return events


def simulate(layout: Layout | MixedLayout, costs: ModelCosts) -> Simulation:
    """Replay one step of ``layout``: every replica class's pipeline, then sync and optimizer per stage."""
    if isinstance(layout, MixedLayout):
        return _simulate_mixed(layout, costs)
    events: list[Event] = []
    for index in range(len(layout.replicas)):
        events.extend(_replay(layout, costs, index))
    step = 0.0
    for s in range(layout.pp):
        finish = max(e.end for e in events if e.stage == s and e.kind == "backward")
        sync_end = finish + grad_sync_s(layout, costs, s)
        for index, replica in enumerate(layout.replicas):
            opt_end = sync_end + optimizer_s(layout, costs, s, replica.units[s])
            events.append(Event(index, s, "sync", -1, finish, sync_end))
            events.append(Event(index, s, "optimizer", -1, sync_end, opt_end))
            step = max(step, opt_end)
    return Simulation(step, tuple(events))


def _simulate_mixed(layout: MixedLayout, costs: ModelCosts) -> Simulation:
    """Replicas of different depth: each one's pipeline, then (as the runtime does) every layer's
    gradient averaged once all are done, then each device's optimizer step."""
    events: list[Event] = []
    for index, part in enumerate(layout.parts):
        events.extend(replace(e, replica=index) for e in _replay(part, costs, 0))
    finish = max(e.end for e in events)
    sync_end = finish + replica_sync_s(costs, layout.sync_link, len(layout.parts))
    step = sync_end
    for index, part in enumerate(layout.parts):
        for s, unit in enumerate(part.replicas[0].units):
            opt_end = sync_end + optimizer_s(part, costs, s, unit)
            events.append(Event(index, s, "sync", -1, finish, sync_end))
            events.append(Event(index, s, "optimizer", -1, sync_end, opt_end))
            step = max(step, opt_end)
    return Simulation(step, tuple(events))
