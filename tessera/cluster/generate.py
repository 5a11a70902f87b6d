"""Generated clusters: random small ones for the planner's tests and regret benchmark, and large
regular ones for its scaling benchmark.

Example:
    >>> random_cluster(3).world_size <= 8
    True
    >>> regular_cluster(4096, types=("H100", "A100-80GB"), regions=3).world_size
    4096
    >>> family_cluster(7, 1000).world_size
    1000
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


# Every catalogue type a family cluster may draw (mixing bf16-capable ones with V100/T4, which have none).
FAMILY_TYPES = ("H100", "A100-80GB", "A100-40GB", "L4", "A10", "RTX4090", "V100", "T4")


def family_cluster(seed: int, devices: int) -> Cluster:
    """A cluster of exactly ``devices`` devices unlike the benchmark's regular ones: 2-6 types (not
    more than the devices allow) with uneven weights, so node counts per type differ; each node has
    1, 2, 4 or 8 devices and lies in one of 1-4 regions."""
    rnd = random.Random(seed)
    types = rnd.sample(FAMILY_TYPES, min(rnd.randint(2, 6), devices))
    weights = [rnd.uniform(0.2, 1.0) for _ in types]
    regions = rnd.randint(1, 4)
    nodes, left = [], devices
    for i, name in enumerate(types):  # every type at least once, leaving a device for each type still to come
        count = rnd.choice([c for c in (1, 2, 4, 8) if c <= left - (len(types) - 1 - i)])
        nodes.append((name, count))
        left -= count
    while left:
        count = rnd.choice([c for c in (1, 2, 4, 8) if c <= left])
        nodes.append((rnd.choices(types, weights)[0], count))
        left -= count
    rnd.shuffle(nodes)
    return Cluster.from_dict(
        {
            "nodes": [
                {"name": f"n{i}", "region": f"r{rnd.randrange(regions)}", "devices": [{"type": t, "count": c}]}
                for i, (t, c) in enumerate(nodes)
            ]
        }
    )


# Link rates a scale cluster draws from, in Gbit/s: slow WAN to fast fabric.
INTER_REGION_GBIT = (0.2, 1.0, 5.0, 10.0, 100.0)
INTER_NODE_GBIT = (25.0, 100.0, 200.0, 400.0, 3200.0)


def scale_cluster(seed: int, max_devices: int = 4096) -> Cluster:
    """A cluster of up to ``max_devices`` devices varying what :func:`family_cluster` does not: often every
    node with 8 devices (where tensor parallelism inside nodes matters), one to three types holding most
    nodes, host-like node names, 1-3 regions of very different sizes, link rates drawn per cluster, and
    some node pairs with links of their own (given per pair)."""
    rnd = random.Random(seed)
    devices = min(max_devices, 2 ** rnd.randint(4, 12) * rnd.choice((1, 1, 1.5)))
    shape = rnd.choice(("all8", "all8", "mostly8", "mixed"))
    big = rnd.sample(FAMILY_TYPES, rnd.randint(1, 3))
    small = rnd.sample([t for t in FAMILY_TYPES if t not in big], rnd.randint(0, 3))
    types = big + small
    weights = [rnd.uniform(3, 10) for _ in big] + [rnd.uniform(0.1, 1) for _ in small]
    n_regions = rnd.randint(1, 3)
    region_weights = [1.0] + [rnd.choice((0.02, 0.1, 0.5, 1.0)) for _ in range(n_regions - 1)]
    style = rnd.choice(("ip-10-{r}-{a}-{b}", "gpu-{region}-{i:04d}", "{type}-{i}", "node{i}"))
    nodes, left = [], int(devices)
    while left:
        if shape == "all8" or (shape == "mostly8" and rnd.random() < 0.85):
            count = 8 if left >= 8 else left
        else:
            count = rnd.choice([c for c in (1, 2, 4, 8) if c <= left])
        left -= count
        i = len(nodes)
        region = rnd.choices(range(n_regions), region_weights)[0]
        kind = rnd.choices(types, weights)[0]
        name = style.format(r=region, a=i // 250, b=i % 250, region=f"r{region}", i=i, type=kind.lower())
        nodes.append({"name": name, "region": f"region-{region}", "devices": [{"type": kind, "count": count}]})
    links: dict = {
        "inter_node": {"gbit_s": rnd.choice(INTER_NODE_GBIT), "latency_us": rnd.choice((5, 10, 20))},
        "inter_region": {"gbit_s": rnd.choice(INTER_REGION_GBIT), "latency_us": rnd.choice((10_000, 50_000, 80_000))},
    }
    pairs = rnd.randint(0, min(64, len(nodes) * (len(nodes) - 1) // 2))
    between = {}
    for _ in range(pairs):  # some pairs joined by a link of their own, faster or slower than the default
        a, b = rnd.sample(range(len(nodes)), 2) if len(nodes) > 1 else (0, 0)
        if a != b:
            ends = tuple(sorted((nodes[a]["name"], nodes[b]["name"])))
            between[ends] = {"gbit_s": rnd.choice((*INTER_REGION_GBIT, *INTER_NODE_GBIT)), "latency_us": 20}
    if between:
        links["between"] = [{"nodes": list(ends), **link} for ends, link in between.items()]
    return Cluster.from_dict({"nodes": nodes, "links": links})
