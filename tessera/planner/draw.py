"""The planner's picture: which device runs which stage, and a simulated timeline of one step.

Left: every device of the cluster, grouped by node, coloured by its pipeline stage and labelled
with its replica; on more than 32 nodes, one bar per region and node kind, split by stage with
counts. Right: the simulator's timeline, one row per (replica kind, stage): forward, backward,
gradient sync and optimizer, with idle time as gaps: where the time goes, at a glance.

Example:
    >>> draw(candidate, cluster, costs, "plan.png")
"""

from __future__ import annotations

from pathlib import Path

from tessera.cluster.spec import Cluster
from tessera.parallel.replicas import replica_ranks
from tessera.planner.costs import ModelCosts
from tessera.planner.layout import ranks_of
from tessera.planner.outer import regions_of
from tessera.planner.simulate import simulate

COLOURS = {"forward": "#4c72b0", "backward": "#dd8452", "sync": "#c44e52", "optimizer": "#8172b3"}


def draw(candidate, cluster: Cluster, costs: ModelCosts, path: str | Path) -> Path:
    """Write the picture of ``candidate`` (a :class:`~tessera.planner.search.Candidate`) to ``path``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    plan, layout = candidate.plan, candidate.layout
    if plan.replicas is not None:  # replicas of different depth: one row per rank
        shown = "+".join(f"tp{r.tp}" if r.tp > 1 else str(r.depth) for r in plan.replicas)
        rows, shape = ranks_of(plan, cluster), f"replicas of depths {shown}"
    else:
        rows, shape = layout.pp * len(layout.replicas), f"dp={plan.dp} tp={plan.tp} pp={plan.pp}"
    own = plan.groups is not None and plan.groups.layouts is not None
    if own:  # a job per region, each its own layout: the timeline is the first group's
        shape = f"{plan.groups.count} fault-tolerant groups ({plan.groups.sync}), each laid out its own way"
    elif plan.groups is not None:  # the timeline is one group's; the title says how the groups meet
        shape = f"{plan.groups.count} groups ({plan.groups.sync}) of {shape}"
    fig, (left, right) = plt.subplots(1, 2, figsize=(14, 1.2 + 0.45 * max(8, rows)))
    _devices(left, plan, cluster, plt.get_cmap("tab20"))
    _timeline(right, layout, costs)
    est = candidate.estimate
    inner = "" if own else f" zero={plan.zero} microbatches={plan.pipeline.microbatches}"
    speed = f"{est.step_s:.3g} s/step, {est.tokens_per_s:,.0f} tokens/s"
    fig.suptitle(f"{shape}{inner}: {speed}; bottleneck: {est.bottleneck}")
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


EACH_NODE_UP_TO = 32  # more nodes than this: one row per region and node kind, not per node


def _devices(ax, plan, cluster: Cluster, cmap) -> None:
    """The device panel: one square per device on up to :data:`EACH_NODE_UP_TO` nodes, else one bar per region
    and node kind (:func:`_device_groups`)."""
    places = _places(plan, cluster)
    if len(cluster.nodes) > EACH_NODE_UP_TO:
        _device_groups(ax, plan, cluster, cmap, places)
        return
    row_of = {node.name: i for i, node in enumerate(cluster.nodes)}
    for index, (node, local, _) in enumerate(cluster.devices()):
        y = row_of[node]
        if places[index] is None:  # left out of the job by the plan
            ax.add_patch(_square(local, y, "lightgrey"))
            ax.text(local + 0.5, y + 0.5, "out", ha="center", va="center", fontsize=7)
            continue
        stage, replica = places[index]
        ax.add_patch(_square(local, y, cmap(stage % 20)))
        label = f"g{stage}" if plan.groups is not None else f"s{stage}"
        ax.text(local + 0.5, y + 0.5, f"{label}\nr{replica}", ha="center", va="center", fontsize=7)
    ax.set_yticks([i + 0.5 for i in range(len(cluster.nodes))])
    ax.set_yticklabels([f"{n.name} ({cluster.device_type(n.name).name})" for n in cluster.nodes], fontsize=8)
    ax.set_xlim(0, max(n.count for n in cluster.nodes))
    ax.set_ylim(len(cluster.nodes), 0)
    ax.set_xticks([])
    ax.set_title("devices: group g, replica r" if plan.groups is not None else "devices: stage s, replica r")


def _places(plan, cluster: Cluster) -> list[tuple[int, int] | None]:
    """Each cluster device's (stage or group, replica) in ``plan``; None where the plan leaves it out."""
    world = ranks_of(plan, cluster)
    where = {plan.device_of(rank): rank for rank in range(world)}
    per_stage = (plan.dp or 1) * plan.tp
    group_of = {n.name: g for g, nodes in enumerate(regions_of(cluster)) for n in nodes}  # a job per region
    places: list[tuple[int, int] | None] = []
    for index, (node, _, _) in enumerate(cluster.devices()):
        rank = where.get(index)
        if rank is None:
            places.append(None)
        elif plan.replicas is not None:  # replicas of different depth take consecutive ranks
            position = replica_ranks(plan, rank)
            places.append((position.stage, position.index))
        elif plan.groups is not None and plan.groups.fault_tolerant:  # a job per region: its group's colour
            places.append((group_of[node], rank))
        elif plan.groups is not None:  # a group per region, no stages: coloured and labelled by group
            group_size = world // plan.groups.count
            places.append((rank // group_size, (rank % group_size) // plan.tp))
        else:
            places.append((rank // per_stage, (rank % per_stage) // plan.tp))
    return places


def _device_groups(ax, plan, cluster: Cluster, cmap, places: list[tuple[int, int] | None]) -> None:
    """One bar per (region, device type, devices per node): its devices split by the stage (or group) they
    run, with how many, and how many replicas; the nodes left out in grey."""
    kinds: dict[tuple, dict] = {}
    offset = 0
    for node in cluster.nodes:
        kind = kinds.setdefault((node.region, cluster.device_type(node.name).name, node.count),
                                {"nodes": 0, "stages": {}, "replicas": set(), "out": 0})  # fmt: skip
        kind["nodes"] += 1
        for place in places[offset : offset + node.count]:
            if place is None:
                kind["out"] += 1
            else:
                kind["stages"][place[0]] = kind["stages"].get(place[0], 0) + 1
                kind["replicas"].add(place[1])
        offset += node.count
    letter = "g" if plan.groups is not None else "s"
    for y, ((_, _, count), kind) in enumerate(kinds.items()):
        total, left = kind["nodes"] * count, 0.0
        for stage, n in sorted(kind["stages"].items()) + [(-1, kind["out"])]:
            if not n:
                continue
            width = n / total
            ax.barh(y, width, left=left, color="lightgrey" if stage < 0 else cmap(stage % 20), edgecolor="white")
            if width > 0.08:  # a label where it fits
                text = "out" if stage < 0 else f"{letter}{stage}"
                ax.text(left + width / 2, y, f"{text}: {n}", ha="center", va="center", fontsize=7)
            left += width
    ax.set_yticks(range(len(kinds)))
    ax.set_yticklabels(
        [f"{region or 'one region'}: {k['nodes']} x {name} x{count} ({len(k['replicas'])} replicas)"
         for (region, name, count), k in kinds.items()],
        fontsize=8,
    )  # fmt: skip
    ax.set_xlim(0, 1)
    ax.set_ylim(len(kinds) - 0.5, -0.5)
    ax.set_xlabel("share of the kind's devices")
    what = "group: devices" if plan.groups is not None else "stage: devices"
    ax.set_title(f"{len(cluster.nodes)} nodes by region and kind ({what})")


def _square(x: float, y: float, colour) -> object:
    from matplotlib.patches import Rectangle

    return Rectangle((x + 0.05, y + 0.05), 0.9, 0.9, color=colour)


def _timeline(ax, layout, costs: ModelCosts) -> None:
    sim = simulate(layout, costs)
    rows = {}
    for e in sim.events:
        key = (e.replica, e.stage)
        rows.setdefault(key, len(rows))
        ax.barh(rows[key], e.end - e.start, left=e.start, color=COLOURS[e.kind], edgecolor="white", linewidth=0.3)
    ax.set_yticks(list(rows.values()))
    ax.set_yticklabels([f"replicas {r} stage {s}" for r, s in rows], fontsize=7)
    ax.invert_yaxis()
    ax.set_xlabel("seconds (simulated; gaps are idle)")
    ax.set_title("one step: " + ", ".join(f"{k}" for k in COLOURS), fontsize=9)
    for kind, colour in COLOURS.items():
        ax.barh(0, 0, color=colour, label=kind)
    ax.legend(loc="lower right", fontsize=7)
