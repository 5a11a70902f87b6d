"""``tessera cluster detect``: describe the local machine as a cluster file.

Catalogued GPUs are recognised by name (and memory, for the A100's two sizes) and keep their
datasheet figures. Anything else — an unknown GPU or this machine's CPU — gets figures
*measured* here: memory from the system, peak TFLOP/s from timed matrix multiplies, memory
bandwidth from a timed copy. Measured figures are achieved, not datasheet, and the file says so.
"""

from __future__ import annotations

import math
import os
import socket
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from tessera.cluster.catalog import CATALOG, DeviceType
from tessera.cluster.spec import Cluster, Node

# (substring of the CUDA device name, catalogue name); the first match wins, so "A100" precedes "A10".
_NAME_PATTERNS = (
    ("H200", "H200"),
    ("H100", "H100"),
    ("A100", "A100"),
    ("A6000", "A6000"),
    ("A10", "A10"),
    ("L4", "L4"),
    ("T4", "T4"),
    ("V100", "V100"),
    ("4090", "RTX4090"),
    ("3090", "RTX3090"),
    ("MI250X", "MI250X"),
)


def catalog_name(device_name: str, memory_gib: float) -> str | None:
    """The catalogue entry for a device reported as ``device_name`` with ``memory_gib`` of memory."""
    for pattern, name in _NAME_PATTERNS:
        if pattern in device_name:
            if name == "A100":
                return "A100-80GB" if memory_gib > 60 else "A100-40GB"
            return name
    return None


def median_seconds(
    fn: Callable[[], Any], repeats: int, min_window_s: float = 0.0, agree: Callable[[int], int] | None = None
) -> float:
    """Median wall time of one call of ``fn`` over ``repeats`` timed windows, after one warm-up call
    (GPU work waited for). Each window runs enough calls to last ``min_window_s``: a rank held to a
    CPU quota is throttled per scheduler period, so a single short call can run at full speed.
    ``agree`` maps this process's call count to the one to use: when ``fn`` is a collective, every
    rank must make the same number of calls."""
    fn()
    calls = 1
    if min_window_s > 0:
        start = time.perf_counter()
        fn()
        calls = max(1, math.ceil(min_window_s / max(time.perf_counter() - start, 1e-6)))
        if agree is not None:
            calls = agree(calls)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        times.append((time.perf_counter() - start) / calls)
    return statistics.median(times)


def measure_peaks(device: torch.device, size: int = 1024, repeats: int = 5) -> dict[str, float]:
    """Achieved dense matmul TFLOP/s per dtype on ``device``."""
    peaks = {}
    for dtype_name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        a = torch.randn(size, size, device=device, dtype=dtype)
        b = torch.randn(size, size, device=device, dtype=dtype)
        seconds = median_seconds(lambda a=a, b=b: a @ b, repeats)
        peaks[dtype_name] = round(2 * size**3 / seconds / 1e12, 4)
    return peaks


def measure_bandwidth(device: torch.device, n_bytes: int = 256 << 20, repeats: int = 3) -> float:
    """Achieved copy bandwidth in GB/s (read plus write)."""
    src = torch.empty(n_bytes // 4, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    seconds = median_seconds(lambda: dst.copy_(src), repeats)
    return round(2 * n_bytes / seconds / 1e9, 1)


def _system_memory_gib() -> float:
    return round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1)


def detect(node_name: str | None = None) -> Cluster:
    """This machine as a one-node cluster (one node per device type, on this machine, if its GPUs differ).
    The types are listed in the order CUDA first numbers them."""
    host = node_name or socket.gethostname()
    if not torch.cuda.is_available():
        cpu = torch.device("cpu")
        measured = DeviceType("cpu", measure_peaks(cpu), _system_memory_gib(), measure_bandwidth(cpu))
        return Cluster((Node(host, "cpu", 1),), device_types={"cpu": measured})
    by_type: dict[str, list[int]] = {}
    for i in range(torch.cuda.device_count()):
        by_type.setdefault(torch.cuda.get_device_name(i), []).append(i)
    nodes, types = [], {}
    for device_name, indices in by_type.items():
        memory = torch.cuda.get_device_properties(indices[0]).total_memory / 2**30
        name = catalog_name(device_name, memory)
        if name is None:  # not catalogued: measure it
            device = torch.device("cuda", indices[0])
            name = device_name.replace(" ", "-")
            types[name] = DeviceType(name, measure_peaks(device, 4096), round(memory, 1), measure_bandwidth(device))
        if len(by_type) == 1:
            nodes.append(Node(host, name, len(indices)))
        else:  # one machine of several device types: a node per type, launched together
            nodes.append(Node(f"{host}/{name}", name, len(indices), machine=host))
    return Cluster(tuple(nodes), device_types=types)


def describe(cluster: Cluster) -> str:
    """A cluster file's text with a header saying where each figure came from."""
    measured = ", ".join(sorted(cluster.device_types)) or "none"
    catalogued = ", ".join(sorted({n.device_type for n in cluster.nodes} & set(CATALOG) - set(cluster.device_types)))
    header = (
        "# written by `tessera cluster detect`\n"
        f"# datasheet figures (tessera.cluster.catalog): {catalogued or 'none'}\n"
        f"# measured here (achieved, not datasheet): {measured}\n"
        "# links are defaults: edit them to match your network\n"
    )
    return header + cluster.to_yaml()
