"""Generated clusters: random small ones for the planner's tests and regret benchmark, and large
regular ones for its scaling benchmark.

Example:
    >>> random_cluster(3).world_size <= 8
    True
    >>> regular_cluster(4096, types=("H100", "A100-80GB"), regions=3).world_size
    4096
"""

from __future__ import annotations

import random

from tessera.cluster.spec import Cluster

# Catalogue types plus two small-memory ones, so that memory, not only speed, decides some plans.
SMALL_TYPES = ("A100-80GB", "A10", "T4", "V100", "small", "tiny")
EXTRA_TYPES = {
    "small": {"peak_tflops": {"fp16": 200, "fp32": 20}, "memory_gib": 3, "bandwidth_gbs": 1000},
    "tiny": {"peak_tflops": {"fp16": 50, "fp32": 10}, "memory_gib": 1.5, "bandwidth_gbs": 300},
}


def random_cluster(seed: int, max_devices: int = 8, max_nodes: int = 3) -> Cluster:
    """A cluster of 2..``max_devices`` devices on up to ``max_nodes`` nodes of random types, in one or two regions."""
    rnd = random.Random(seed)
    left = rnd.randint(2, max_devices)
    nodes = []
    while left:
        count = left if len(nodes) == max_nodes - 1 else rnd.randint(1, min(4, left))
        left -= count
        nodes.append(
            {
                "name": f"n{len(nodes)}",
                "region": rnd.choice(("r0", "r0", "r1")),
                "devices": [{"type": rnd.choice(SMALL_TYPES), "count": count}],
            }
        )
    return Cluster.from_dict({"nodes": nodes, "device_types": EXTRA_TYPES})


def regular_cluster(devices: int, types: tuple[str, ...], regions: int = 1, per_node: int = 8) -> Cluster:
    """``devices`` devices, ``per_node`` per node, node types and regions taken in turn."""
    nodes = [
        {"name": f"n{i}", "region": f"r{i % regions}", "devices": [{"type": types[i % len(types)], "count": per_node}]}
        for i in range(devices // per_node)
    ]
    return Cluster.from_dict({"nodes": nodes})
