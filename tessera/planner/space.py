"""The planner's search space: tp groups, degrees, device placements, layer splits and options.

Everything here enumerates or proposes; :mod:`tessera.planner.search` judges and picks.

Example:
    >>> units = units_of(cluster, tp=2, dtype="bf16")
    >>> placements(units, pp=2, dp=len(units) // 2)[0]
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from dataclasses import dataclass

from tessera.cluster.spec import Cluster
from tessera.plan import grid_order
from tessera.planner.costs import ModelCosts
from tessera.planner.layout import UnitSpec, unit_of

PLACEMENT_LIMIT = 5000
ENUMERATE_UNITS = 8  # a "small cluster": at most this many tp groups


@dataclass(frozen=True)
class Unit:
    """A tensor-parallel group of devices inside one node."""

    node: str
    devices: tuple[int, ...]  # indices in the cluster file's device order
    spec: UnitSpec
    alike: str = ""  # units whose nodes are interchangeable share this (see alike_nodes); "" for none


def alike_nodes(cluster: Cluster) -> dict[str, str]:
    """Each node's class of interchangeable nodes: nodes alone on their machine, named in no pair link, of
    one device type, count and region, can trade places without changing any cost. Others are their own."""
    per_host: dict[str, int] = {}
    for n in cluster.nodes:
        per_host[n.host] = per_host.get(n.host, 0) + 1
    paired = {name for pair in cluster.pair_links for name in pair}
    return {
        n.name: n.name if per_host[n.host] > 1 or n.host in paired else f"{n.device_type}×{n.count}@{n.region}"
        for n in cluster.nodes
    }


@dataclass(frozen=True)
class Options:
    """The memory-versus-time choices tried for every placement."""

    zero: int
    offload: bool
    recompute: str


Grid = tuple[tuple[Unit, ...], ...]  # grid[stage][replica]


def units_of(cluster: Cluster, tp: int, dtype: str) -> list[Unit] | None:
    """The cluster's devices as tp-sized groups inside nodes (None: some node's count is not a multiple of tp)."""
    units, first = [], 0  # first: the node's first device in the cluster's order
    alike = alike_nodes(cluster)
    for node in cluster.nodes:
        if node.count % tp:
            return None
        members = [(node.name, i, cluster.device_type(node.name)) for i in range(node.count)]
        for i in range(0, node.count, tp):
            devices = tuple(range(first + i, first + i + tp))
            units.append(Unit(node.name, devices, unit_of(cluster, members[i : i + tp], dtype), alike[node.name]))
        first += node.count
    return units


def degrees(cluster: Cluster, costs: ModelCosts, global_batch: int) -> Iterator[tuple[int, int, int]]:
    """Every (tp, pp, dp) the cluster, model and batch allow."""
    world = cluster.world_size
    for tp in (1, 2, 4, 8):
        if tp > 1 and (costs.heads % tp or any(n.count % tp for n in cluster.nodes)):
            continue
        for pp in range(1, min(costs.n_layers, world // tp) + 1):
            if (world // tp) % pp or world % tp:
                continue
            dp = world // (tp * pp)
            if dp <= global_batch:
                yield tp, pp, dp


def _columns_canonical(grid: Grid) -> Grid:
    """The grid with replicas (columns) in a fixed order: placements equal up to a reordering are one."""
    columns = sorted(zip(*grid), key=lambda col: tuple(u.devices for u in col))
    return tuple(zip(*columns))


def placements(units: list[Unit], pp: int, dp: int, limit: int = PLACEMENT_LIMIT) -> list[tuple[str, Grid]]:
    """Placements of ``units`` on a pp × dp grid: every distinct one when there are at most ``limit``
    (units of one node are interchangeable), else the canonical ones (module docstring)."""
    if len(units) <= ENUMERATE_UNITS and limit > 0:
        found = _all_placements(units, pp, dp, limit)
        if found is not None:
            return found
    return _canonical_placements(units, pp, dp)


def launchable(grid: Grid) -> bool:
    """Whether ``torchrun`` can start this placement: on several machines it numbers ranks machine
    by machine, so each node's devices must take consecutive ranks, in their local order (the
    plan then says which ``--node-rank`` each machine gets). One machine can run any placement."""
    order = grid_order(len(grid), len(grid[0]), len(grid[0][0].devices))
    devices = [(grid[s][r].node, grid[s][r].devices[t]) for s, r, t in order]
    if len({node for node, _ in devices}) == 1:
        return True
    blocks: dict[str, list[int]] = {}
    previous = None
    for node, device in devices:
        if node != previous and node in blocks:
            return False  # the node's ranks would not be consecutive
        blocks.setdefault(node, []).append(device)
        previous = node
    return all(ds == sorted(ds) for ds in blocks.values())


def grids(units: list[Unit], pp: int, dp: int, alike: bool = False) -> Iterator[Grid]:
    """Every launchable placement of ``units`` on a pp × dp grid (units of one node interchangeable; with
    ``alike``, nodes of one :func:`alike_nodes` class too: one placement stands for all their swaps)."""
    by_class: dict[str, list[Unit]] = {}
    for u in units:
        by_class.setdefault(_class(u, alike), []).append(u)
    for order in multiset_permutations([_class(u, alike) for u in units]):
        pools = {n: iter(us) for n, us in by_class.items()}
        cells = [next(pools[n]) for n in order]
        grid = tuple(tuple(cells[s * dp + r] for r in range(dp)) for s in range(pp))
        if launchable(grid):
            yield grid


def _class(unit: Unit, alike: bool) -> str:
    return unit.alike if alike and unit.alike else unit.node


def _all_placements(units: list[Unit], pp: int, dp: int, limit: int) -> list[tuple[str, Grid]] | None:
    seen: dict[tuple, Grid] = {}
    for grid in grids(units, pp, dp, alike=True):
        key = tuple(sorted(zip(*[[_class(u, True) for u in row] for row in grid])))  # the same up to replica order
        if key not in seen:
            seen[key] = grid
            if len(seen) > limit:
                return None
    return [("enumerated", g) for g in seen.values()]


def multiset_permutations(items: list[str]) -> Iterator[tuple[str, ...]]:
    """Distinct orderings of ``items`` (each once, however many repeats)."""
    counts: dict[str, int] = {}
    for x in items:
        counts[x] = counts.get(x, 0) + 1
    keys = sorted(counts)
    out: list[str] = []

    def rec() -> Iterator[tuple[str, ...]]:
        if len(out) == len(items):
            yield tuple(out)
            return
        for k in keys:
            if counts[k]:
                counts[k] -= 1
                out.append(k)
                yield from rec()
                out.pop()
                counts[k] += 1

    return rec()


def _canonical_placements(units: list[Unit], pp: int, dp: int) -> list[tuple[str, Grid]]:
    def speed(u: Unit) -> float:
        return u.spec.peak_tflops

    orders = {
        "fast first": sorted(units, key=lambda u: (-speed(u), u.devices)),
        "slow first": sorted(units, key=lambda u: (speed(u), u.devices)),
        "file order": list(units),
    }
    out, seen = [], set()
    for name, order in orders.items():
        for fill in ("stages", "replicas"):
            if fill == "stages":
                grid = tuple(tuple(order[s * dp + r] for r in range(dp)) for s in range(pp))
            else:
                grid = tuple(tuple(order[r * pp + s] for r in range(dp)) for s in range(pp))
            key = tuple(tuple(u.devices for u in row) for row in _columns_canonical(grid))
            if key not in seen and launchable(grid):
                seen.add(key)
                out.append((f"{name}, filling {fill}", grid))
    return out


def splits(n_layers: int, pp: int) -> Iterator[tuple[tuple[int, int], ...]]:
    """Every split of ``n_layers`` into ``pp`` non-empty contiguous stages."""
    for cuts in itertools.combinations(range(1, n_layers), pp - 1):
        bounds = (0, *cuts, n_layers)
        yield tuple(zip(bounds[:-1], bounds[1:]))


def proportional_split(costs: ModelCosts, speeds: list[float]) -> tuple[tuple[int, int], ...]:
    """Layers per stage in proportion to stage speed, counting the first and last parts' work."""
    pp, n = len(speeds), costs.n_layers
    block = costs.parts["block"].forward_s or 1.0
    extra = [costs.parts["first"].forward_s / block] + [0.0] * (pp - 2) + [costs.parts["last"].forward_s / block]
    if pp == 1:
        return ((0, n),)
    total = n + sum(extra)
    want = [max(1.0, total * v / sum(speeds) - e) for v, e in zip(speeds, extra)]
    counts = [max(1, round(w * n / sum(want))) for w in want]
    while sum(counts) > n:
        counts[max((i for i in range(pp) if counts[i] > 1), key=lambda i: counts[i] - want[i])] -= 1
    while sum(counts) < n:
        counts[min(range(pp), key=lambda i: counts[i] - want[i])] += 1
    bounds = [0, *itertools.accumulate(counts)]
    return tuple(zip(bounds[:-1], bounds[1:]))


def option_sets(dp: int, pp: int, tp: int) -> list[Options]:
    """ZeRO stage × offload × recompute choices valid for these degrees, roughly fastest first.

    ZeRO-1/2 move what DDP moves and step a 1/dp shard of the optimizer, so they come first;
    ZeRO-3 gathers parameters again; recompute repeats the forward; offload crosses the host link.
    """
    zeros = (1, 2, 0, 3) if dp > 1 else (0,)
    out = []
    for offload in (False, True) if pp == 1 and tp == 1 and dp > 1 else (False,):
        for recompute in ("none", "full"):
            out.extend(Options(zero, offload, recompute) for zero in zeros if zero or not offload)
    return out
