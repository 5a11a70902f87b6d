"""The planner's picture: which device runs which stage, and a simulated timeline of one step.

Left: every device of the cluster, grouped by node, coloured by its pipeline stage and labelled
with its replica. Right: the simulator's timeline, one row per (replica kind, stage): forward,
backward, gradient sync and optimizer, with idle time as gaps — where the time goes, at a glance.

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
        rows, shape = ranks_of(plan, cluster), f"replicas of depths {'+'.join(str(r.depth) for r in plan.replicas)}"
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


def _devices(ax, plan, cluster: Cluster, cmap) -> None:
    """One square per device, row per node, coloured by stage, labelled with its replica."""
    devices = cluster.devices()
    where = {plan.device_of(rank): rank for rank in range(ranks_of(plan, cluster))}
    per_stage = (plan.dp or 1) * plan.tp
    row_of = {node.name: i for i, node in enumerate(cluster.nodes)}
    group_of = {n.name: g for g, nodes in enumerate(regions_of(cluster)) for n in nodes}  # a job per region
    for index, (node, local, _) in enumerate(devices):
        if index not in where:  # left out of the job by the plan
            ax.add_patch(_square(local, row_of[node], "lightgrey"))
            ax.text(local + 0.5, row_of[node] + 0.5, "out", ha="center", va="center", fontsize=7)
            continue
        rank = where[index]
        if plan.replicas is not None:  # replicas of different depth take consecutive ranks
            position = replica_ranks(plan, rank)
            stage, replica = position.stage, position.index
        elif plan.groups is not None and plan.groups.fault_tolerant:  # a job per region: its group's colour
            stage, replica = group_of[node], rank
        elif plan.groups is not None:  # a group per region, no stages: coloured and labelled by group
            group_size = ranks_of(plan, cluster) // plan.groups.count
            stage, replica = rank // group_size, (rank % group_size) // plan.tp
        else:
            stage, replica = rank // per_stage, (rank % per_stage) // plan.tp
        y = row_of[node]
        ax.add_patch(_square(local, y, cmap(stage % 20)))
        label = f"g{stage}" if plan.groups is not None else f"s{stage}"
        ax.text(local + 0.5, y + 0.5, f"{label}\nr{replica}", ha="center", va="center", fontsize=7)
    ax.set_yticks([i + 0.5 for i in range(len(cluster.nodes))])
    ax.set_yticklabels([f"{n.name} ({cluster.device_type(n.name).name})" for n in cluster.nodes], fontsize=8)
    ax.set_xlim(0, max(n.count for n in cluster.nodes))
    ax.set_ylim(len(cluster.nodes), 0)
    ax.set_xticks([])
    ax.set_title("devices: group g, replica r" if plan.groups is not None else "devices: stage s, replica r")


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
