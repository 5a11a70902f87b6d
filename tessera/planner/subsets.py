"""Which devices to use: a slow device can cost more than it gives, so plans may leave it out.

A device that computes slowly still joins every gradient synchronisation of its data-parallel
group, and on some clusters its link or its host makes each of those slower for everyone.
:func:`plan_for <tessera.planner.plan_for>` therefore also searches the cluster without its
slowest speed classes (every node whose devices are slower than a threshold, for each
threshold among the node types' speeds), and keeps whichever plan is fastest. The search
proper (:func:`~tessera.planner.search.search`) stays a search over a fixed set of devices,
which the exhaustive oracle checks it against.

Example:
    >>> for sub, kept in subsets(cluster, "bf16"):
    ...     print(sub.world_size, kept)     # the devices kept, as indices into the full cluster
"""

from __future__ import annotations

from dataclasses import replace

from tessera.cluster.spec import Cluster
from tessera.planner.search import Candidate

MAX_DROPPED_CLASSES = 3  # at most this many extra searches (each on a smaller cluster)
MAX_DEVICES = 64  # beyond this, searching again costs more than the planner's time budget allows


def subsets(cluster: Cluster, precision: str) -> list[tuple[Cluster, list[int]]]:
    """The cluster without its slowest 1, 2, ... speed classes (while at least one node remains), each
    with the full-cluster indices of the devices it keeps, in its own device order."""
    if cluster.world_size > MAX_DEVICES:
        return []
    speed = {n.name: _peak(cluster, n.name, precision) for n in cluster.nodes}
    thresholds = sorted(set(speed.values()))[1:]  # keep nodes at least this fast
    out = []
    for threshold in thresholds[:MAX_DROPPED_CLASSES]:
        keep = {name for name, s in speed.items() if s >= threshold}
        nodes = tuple(n for n in cluster.nodes if n.name in keep)
        pairs = {pair: link for pair, link in cluster.pair_links.items() if pair <= keep}
        sub = Cluster(nodes, cluster.device_types, cluster.links, pairs)
        kept = [i for i, (node, _, _) in enumerate(cluster.devices()) if node in keep]
        out.append((sub, kept))
    return out


def _peak(cluster: Cluster, node: str, precision: str) -> float:
    t = cluster.device_type(node)
    return t.peak(precision) or t.peak("fp32") or 0.0


def on_full_cluster(candidate: Candidate, kept: list[int], cluster: Cluster) -> Candidate:
    """``candidate``, planned on a sub-cluster, with its placement in the full cluster's device indices."""
    plan = candidate.plan
    world = len(plan.placement) if plan.placement is not None else len(kept)
    placement = tuple(kept[plan.device_of(rank)] for rank in range(world))
    used = set(placement)
    left = [f"{node}:{i}" for d, (node, i, _) in enumerate(cluster.devices()) if d not in used]
    note = (
        f"uses {world} of {cluster.world_size} devices, leaving out {', '.join(left)}: their compute is worth "
        "less than what they would add to every step (launch with that many ranks)"
    )
    return replace(candidate, plan=replace(plan, placement=placement), notes=(*candidate.notes, note))
