"""The cluster description: nodes and their devices, device types, and the links between them.

A ``cluster.yaml``::

    nodes:
      - name: a
        region: us-east                      # optional; nodes in different regions talk over inter_region
        devices: [{type: A100-80GB, count: 8}]
      - name: b
        devices: [{type: L4, count: 4}]
      - name: c                              # a machine with two kinds of GPU: one entry per type, in the
        devices: [{type: A100-80GB, count: 2}, {type: L4, count: 2}]   # order CUDA numbers them
    device_types:                            # optional: types missing from the catalogue, or overrides
      MyGPU: {peak_tflops: {bf16: 200, fp32: 20}, memory_gib: 48, bandwidth_gbs: 1000}
    links:                                   # optional: defaults below
      intra_node: {gbit_s: 2400, latency_us: 5}        # gigabits per second, as links are sold
      inter_node: {gbit_s: 200, latency_us: 10}
      inter_region: {gbit_s: 8, latency_us: 50000}
      between:                               # pairs of nodes with their own link
        - {nodes: [a, b], gbit_s: 100, latency_us: 20}
        # any link may add burst_bytes: what a shaped link passes at once after idling (default 0)

A device entry needs its ``count``. A machine with several device types lists one entry per type; each entry
becomes a node of its own, named ``machine/type`` (``c/A100-80GB``, ``c/L4``), on that machine: they share the
intra-node link, a ``between`` link naming the machine applies to them all, and the machine is launched as one
torchrun node with all its devices (``tessera plan`` prints it so).

A link's bandwidth is ``gbit_s`` (Gbit/s); ``bandwidth_gbs`` (GB/s, a
byte unit: 1 GB/s = 8 Gbit/s) is still read, as a deprecated alias. A device type's ``bandwidth_gbs`` is its
memory bandwidth in GB/s, as GPU data sheets give it. ``tessera cluster check`` prints every node, device and
link with its units.

Every mistake is a :class:`ClusterError` naming the node (or link) and the field.

Example:
    >>> cluster = Cluster.from_dict({"nodes": [{"name": "a", "devices": [{"type": "H100", "count": 8}]}]})
    >>> cluster.world_size, cluster.device_type("a").memory_gib
    (8, 79.6)
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

from tessera.cluster.catalog import CATALOG, DeviceType, lookup
from tessera.errors import ClusterError, nearest
from tessera.inputs import InputError, load_yaml_file, shown

DTYPES = ("fp32", "bf16", "fp16", "fp8")


# The share of a device's memory a plan may fill: allocator fragmentation and the runtime's own
# buffers (CUDA context, workspace) take the rest. The planner and the emulator both use it.
USABLE_MEMORY = 0.9
# Bounds that keep a typo (count: 80000000) from making the planner search forever.
MAX_DEVICES_PER_NODE = 1024
MAX_NODES = 65_536


@dataclass(frozen=True)
class Link:
    """A network path: bandwidth in GB/s (bytes, not bits) and one-way latency in microseconds."""

    bandwidth_gbs: float
    latency_us: float
    # The collectives library on this link. gloo reduce-scatters by all-reducing the whole buffer and
    # keeping a slice (ProcessGroupGloo::reduce_scatter_tensor_coalesced): twice a ring's bytes.
    backend: str = "nccl"
    # Bytes the link passes at once after it has idled: a token-bucket shaper's depth (tc tbf on the
    # testbed; a cloud's egress policer). A live profile measures it; 0 for a link without one.
    burst_bytes: float = 0.0

    def seconds(self, n_bytes: float) -> float:
        """Time to move ``n_bytes`` over this link once."""
        return self.latency_us * 1e-6 + n_bytes / (self.bandwidth_gbs * 1e9)

    def shared_by(self, flows: int) -> Link:
        """This link as each of ``flows`` transfers crossing it at once sees it: an even share of its bandwidth
        (and of its burst), its latency whole."""
        if flows <= 1:
            return self
        return Link(self.bandwidth_gbs / flows, self.latency_us, self.backend, self.burst_bytes / flows)

    def burst_s(self, n_bytes: float) -> float:
        """What a transfer of ``n_bytes`` that starts on an idle link saves: its first ``burst_bytes`` pass at once."""
        return min(self.burst_bytes, n_bytes) / (self.bandwidth_gbs * 1e9)

    def all_reduce_s(self, n_bytes: float, n: int, calls: int = 1) -> float:
        """Ring all-reduce of ``n_bytes`` over ``n`` ranks joined by this link (reduce-scatter + all-gather),
        issued as ``calls`` all-reduces one after the other (buckets): each pays the ring's latency."""
        if n <= 1:
            return 0.0
        return 2 * (n - 1) / n * n_bytes / (self.bandwidth_gbs * 1e9) + calls * 2 * (n - 1) * self.latency_us * 1e-6

    @property
    def has_streams(self) -> bool:
        """Whether collectives on this link run beside compute on streams of their own. gloo carries CPU
        tensors, and a CPU has no streams: FSDP2's gather and reduce-scatter streams are the compute
        thread there, so each of its collectives blocks the computation that issues it."""
        return self.backend != "gloo"

    def reduce_scatter_steps(self, n: int) -> int:
        """Ring steps of one reduce-scatter over ``n`` ranks: ``n − 1``, or an all-reduce's ``2(n − 1)`` on gloo.
        Each step moves ``1/n`` of the buffer and pays one latency."""
        return 2 * (n - 1) if self.backend == "gloo" else n - 1


DEFAULT_LINKS = {
    "intra_node": Link(300.0, 5.0),  # NVLink-class
    "inter_node": Link(25.0, 10.0),  # 200 Gb/s InfiniBand / RoCE
    "inter_region": Link(1.0, 50_000.0),  # a WAN path between regions
}


@dataclass(frozen=True)
class Node:
    """Devices of one type on one machine. A machine with several types is several nodes with its name as their
    ``machine`` (and ``machine/type`` as their own names)."""

    name: str
    device_type: str  # a catalogue name or a key of the file's device_types
    count: int
    region: str = "default"
    machine: str = ""  # the machine it is part of, when that machine holds several device types

    @property
    def host(self) -> str:
        """The machine: one torchrun node, one intra-node link."""
        return self.machine or self.name


@dataclass(frozen=True)
class Cluster:
    """Nodes of devices and the links between them (see the module docstring for the file format)."""

    nodes: tuple[Node, ...]
    device_types: dict[str, DeviceType] = field(default_factory=dict)
    links: dict[str, Link] = field(default_factory=lambda: dict(DEFAULT_LINKS))
    pair_links: dict[frozenset[str], Link] = field(default_factory=dict)

    # ------------------------------------------------------------------ queries
    @property
    def world_size(self) -> int:
        return sum(n.count for n in self.nodes)

    @cached_property
    def _by_name(self) -> dict[str, Node]:
        return {n.name: n for n in self.nodes}

    def node(self, name: str) -> Node:
        if name in self._by_name:
            return self._by_name[name]
        raise ClusterError(f"no node named {name!r}{nearest(name, [n.name for n in self.nodes])}.")

    def describe(self) -> str:
        """Every node with its devices, and every link, with units (what ``tessera cluster check`` prints)."""
        lines = []
        for n in self.nodes:
            t = self.device_type(n.name)
            peaks = ", ".join(f"{k} {v:g}" for k, v in t.peak_tflops.items())
            lines.append(f"node {n.name} ({n.region}): {n.count} x {t.name}, {t.memory_gib:g} GiB, {peaks} TFLOP/s, "
                         f"memory {t.bandwidth_gbs:g} GB/s")  # fmt: skip
        named = [*self.links.items(), *((" - ".join(sorted(pair)), link) for pair, link in self.pair_links.items())]
        for name, link in named:
            burst = f", bursts of {link.burst_bytes:,.0f} B" if link.burst_bytes else ""
            lines.append(f"link {name}: {link.bandwidth_gbs * 8:g} Gbit/s ({link.bandwidth_gbs:g} GB/s), "
                         f"latency {link.latency_us:g} us{burst}")  # fmt: skip
        return "\n".join(lines)

    def device_type(self, node: str) -> DeviceType:
        """The device type of ``node``'s devices (the file's own figures win over the catalogue)."""
        name = self.node(node).device_type
        return self.device_types.get(name) or lookup(name)  # type: ignore[return-value]

    def devices(self) -> list[tuple[str, int, DeviceType]]:
        """Every device, in rank order: (node, local index, type)."""
        return [(n.name, i, self.device_type(n.name)) for n in self.nodes for i in range(n.count)]

    def hosts(self) -> list[tuple[str, list[Node]]]:
        """Every machine, in the file's order, with its nodes (one, or one per device type)."""
        machines: dict[str, list[Node]] = {}
        for n in self.nodes:
            machines.setdefault(n.host, []).append(n)
        return list(machines.items())

    def link(self, a: str, b: str) -> Link:
        """The link between nodes ``a`` and ``b`` (the same machine: the intra-node link)."""
        a, b = self.node(a).host, self.node(b).host
        if a == b:
            return self.links["intra_node"]
        if (pair := frozenset((a, b))) in self.pair_links:
            return self.pair_links[pair]
        same_region = self.node(a).region == self.node(b).region
        return self.links["inter_node" if same_region else "inter_region"]

    def worst_link(self, nodes: set[str]) -> Link:
        """The slowest link between any two of ``nodes`` (the intra-node link for nodes of one machine)."""
        hosts = {self.node(n).host for n in nodes}
        if len(hosts) == 1:
            return self.links["intra_node"]
        regions = {self.node(n).region for n in nodes}
        link = self.links["inter_node" if len(regions) == 1 else "inter_region"]
        for pair, pair_link in self.pair_links.items():
            if pair <= hosts and pair_link.bandwidth_gbs < link.bandwidth_gbs:
                link = pair_link
        return link

    # ------------------------------------------------------------- file format
    @classmethod
    def load(cls, path: str | Path) -> Cluster:
        """Read and validate a cluster file (write one with ``tessera cluster detect``)."""
        try:
            data = load_yaml_file(path, "cluster file")
        except InputError as exc:
            raise ClusterError(str(exc)) from None
        return cls.from_dict(data, source=str(path))

    @classmethod
    def from_dict(cls, data: Any, source: str = "the cluster") -> Cluster:
        """Validate a parsed cluster file; every error names the node or link and the field."""
        if not isinstance(data, dict):
            raise ClusterError(f"{source}: expected a mapping with 'nodes', got {type(data).__name__}.")
        _known_keys(data, ("nodes", "device_types", "links"), source)
        raw_types = data.get("device_types") or {}
        if not isinstance(raw_types, dict):
            raise ClusterError(
                f"{source}: device_types must be a mapping of type name to figures, got {shown(raw_types)}."
            )
        types = {str(name): _device_type(str(name), spec, source) for name, spec in raw_types.items()}
        nodes = _nodes(data.get("nodes"), types, source)
        links, pairs = _links(data.get("links") or {}, {n.host for n in nodes}, source)
        return cls(tuple(nodes), types, links, pairs)

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "nodes": [
                {
                    "name": host,
                    "region": parts[0].region,
                    "devices": [{"type": n.device_type, "count": n.count} for n in parts],
                }
                for host, parts in self.hosts()
            ]  # fmt: skip
        }
        if self.device_types:
            out["device_types"] = {
                name: {"peak_tflops": t.peak_tflops, "memory_gib": t.memory_gib, "bandwidth_gbs": t.bandwidth_gbs}
                for name, t in self.device_types.items()
            }
        links: dict[str, Any] = {k: _link_dict(v) for k, v in self.links.items()}
        if self.pair_links:
            links["between"] = [{"nodes": sorted(pair), **_link_dict(v)} for pair, v in self.pair_links.items()]
        out["links"] = links
        return out

    def to_yaml(self) -> str:
        import yaml

        return yaml.safe_dump(self.to_dict(), sort_keys=False)


# ------------------------------------------------------------------- validation
def _known_keys(data: dict, allowed: tuple[str, ...], where: str) -> None:
    for key in data:
        if key not in allowed:
            raise ClusterError(
                f"{where}: unknown field {key!r}{nearest(str(key), allowed)}; fields: {', '.join(allowed)}."
            )


def _positive(value: Any, where: str, allow_zero: bool = False) -> float:
    ok = (
        isinstance(value, (int, float))
        and not isinstance(value, bool)
        and math.isfinite(value)
        and (value >= 0 if allow_zero else value > 0)
    )
    if not ok:
        kind = "non-negative" if allow_zero else "positive"
        raise ClusterError(f"{where} must be a {kind} number, got {shown(value)} (finite: no .inf or .nan).")
    return float(value)


def _device_type(name: str, spec: Any, source: str) -> DeviceType:
    where = f"{source}: device_types.{name}"
    if not isinstance(spec, dict):
        raise ClusterError(f"{where} must be a mapping (peak_tflops, memory_gib, bandwidth_gbs).")
    _known_keys(spec, ("peak_tflops", "memory_gib", "bandwidth_gbs"), where)
    base = lookup(name)  # figures the file leaves out come from the catalogue
    peaks = spec.get("peak_tflops", base.peak_tflops if base else None)
    if not isinstance(peaks, dict) or not peaks:
        raise ClusterError(
            f"{where}.peak_tflops must map a dtype ({', '.join(DTYPES)}) to TFLOP/s, e.g. {{bf16: 120}}."
        )
    for dtype, value in peaks.items():
        if dtype not in DTYPES:
            raise ClusterError(f"{where}.peak_tflops: unknown dtype {dtype!r}{nearest(str(dtype), DTYPES)}.")
        _positive(value, f"{where}.peak_tflops.{dtype}")
    memory = _positive(spec.get("memory_gib", base.memory_gib if base else None), f"{where}.memory_gib")
    bandwidth = _positive(spec.get("bandwidth_gbs", base.bandwidth_gbs if base else None), f"{where}.bandwidth_gbs")
    return DeviceType(name, {k: float(v) for k, v in peaks.items()}, memory, bandwidth)


def _nodes(raw: Any, types: dict[str, DeviceType], source: str) -> list[Node]:
    if not isinstance(raw, list) or not raw:
        raise ClusterError(f"{source}: 'nodes' must be a non-empty list of nodes (name, devices).")
    if len(raw) > MAX_NODES:
        raise ClusterError(f"{source}: {len(raw)} nodes; a cluster file describes at most {MAX_NODES}.")
    nodes: list[Node] = []
    for i, spec in enumerate(raw):
        where = f"{source}: nodes[{i}]"
        if not isinstance(spec, dict):
            raise ClusterError(f"{where} must be a mapping with name and devices.")
        _known_keys(spec, ("name", "region", "devices"), where)
        name = spec.get("name")
        if not isinstance(name, str) or not name:
            raise ClusterError(f"{where}.name must be a non-empty string.")
        if "/" in name:
            raise ClusterError(f"{where}.name={name!r}: a node name has no '/' (it joins a machine to a device type).")
        where = f"{source}: node {name!r}"
        if any(n.host == name for n in nodes):
            raise ClusterError(f"{where}: the name is used twice; node names must be unique.")
        region = spec.get("region", "default")
        if not isinstance(region, str) or not region:
            raise ClusterError(f"{where}.region must be a non-empty string, got {region!r}.")
        devices = spec.get("devices")
        if not isinstance(devices, list) or not devices or not all(isinstance(d, dict) for d in devices):
            raise ClusterError(
                f"{where}.devices must be a list of {{type, count}} entries, e.g. [{{type: H100, count: 8}}] "
                "(a machine with several kinds of device: one entry per type)."
            )
        entries = [_device_entry(entry, f"{where}.devices[{k}]", types) for k, entry in enumerate(devices)]
        kinds = [dtype for dtype, _ in entries]
        if len(set(kinds)) < len(kinds):
            twice = sorted({k for k in kinds if kinds.count(k) > 1})
            raise ClusterError(f"{where}.devices lists type {twice[0]!r} twice: give each type once, with its count.")
        for dtype, count in entries:
            if len(entries) == 1:
                nodes.append(Node(name, dtype, count, region))
            else:  # one node per device type, all on this machine
                nodes.append(Node(f"{name}/{dtype}", dtype, count, region, machine=name))
        if sum(count for _, count in entries) > MAX_DEVICES_PER_NODE:
            raise ClusterError(f"{where}: more than {MAX_DEVICES_PER_NODE} devices on one machine.")
    return nodes


def _device_entry(entry: dict, where: str, types: dict[str, DeviceType]) -> tuple[str, int]:
    """One ``{type, count}`` entry of a node's devices, checked."""
    _known_keys(entry, ("type", "count"), where)
    if "count" not in entry:
        raise ClusterError(
            f"{where} has no count: write count: N, the devices of type {entry.get('type')!r} this node holds "
            "(e.g. count: 8)."
        )
    dtype, count = entry.get("type"), entry["count"]
    if not isinstance(dtype, str) or (dtype not in types and lookup(dtype) is None):
        hint = nearest(str(dtype), [*CATALOG, *types])
        raise ClusterError(
            f"{where}.type={dtype!r} is not in the catalogue{hint} and the file gives no figures for it: add "
            f"device_types.{dtype}: {{peak_tflops: {{bf16: ...}}, memory_gib: ..., bandwidth_gbs: ...}}, or use one "
            f"of {', '.join(CATALOG)}."
        )
    if isinstance(count, bool) or not isinstance(count, int) or not 1 <= count <= MAX_DEVICES_PER_NODE:
        raise ClusterError(
            f"{where}.count must be a positive integer (at most {MAX_DEVICES_PER_NODE}), got {shown(count)}."
        )
    return dtype, count


LINK_KEYS = ("gbit_s", "bandwidth_gbs", "latency_us", "burst_bytes")


def _link(spec: Any, where: str) -> Link:
    if not isinstance(spec, dict):
        raise ClusterError(f"{where} must be a mapping with gbit_s (Gbit/s) and latency_us.")
    _known_keys(spec, LINK_KEYS, where)
    if "gbit_s" in spec and "bandwidth_gbs" in spec:
        raise ClusterError(
            f"{where} gives both gbit_s and bandwidth_gbs: keep gbit_s (Gbit/s) alone (bandwidth_gbs, in GB/s, is "
            "its deprecated form)."
        )
    if "bandwidth_gbs" in spec:  # the deprecated byte unit: 1 GB/s = 8 Gbit/s
        warnings.warn(
            f"{where}.bandwidth_gbs (GB/s) is deprecated: write gbit_s (Gbit/s), eight times the value.",
            FutureWarning,
            stacklevel=2,
        )
        gbytes = _positive(spec.get("bandwidth_gbs"), f"{where}.bandwidth_gbs")
    else:
        gbytes = _positive(spec.get("gbit_s"), f"{where}.gbit_s") / 8
    return Link(
        gbytes,
        _positive(spec.get("latency_us", 0.0), f"{where}.latency_us", allow_zero=True),
        burst_bytes=_positive(spec.get("burst_bytes", 0.0), f"{where}.burst_bytes", allow_zero=True),
    )


def _link_dict(link: Link) -> dict[str, float]:
    """A link as the cluster file writes it (burst_bytes only where there is one)."""
    out = {"gbit_s": link.bandwidth_gbs * 8, "latency_us": link.latency_us}
    if link.burst_bytes:
        out["burst_bytes"] = link.burst_bytes
    return out


def _links(raw: Any, names: set[str], source: str) -> tuple[dict[str, Link], dict[frozenset[str], Link]]:
    where = f"{source}: links"
    if not isinstance(raw, dict):
        raise ClusterError(f"{where} must be a mapping (intra_node, inter_node, inter_region, between).")
    _known_keys(raw, (*DEFAULT_LINKS, "between"), where)
    links = dict(DEFAULT_LINKS)
    for kind in DEFAULT_LINKS:
        if kind in raw:
            links[kind] = _link(raw[kind], f"{where}.{kind}")
    pairs: dict[frozenset[str], Link] = {}
    between = raw.get("between") or []
    if not isinstance(between, list):
        raise ClusterError(f"{where}.between must be a list of {{nodes: [a, b], gbit_s, latency_us}}.")
    for i, spec in enumerate(between):
        here = f"{where}.between[{i}]"
        ends = spec.get("nodes") if isinstance(spec, dict) else None
        if not isinstance(ends, list) or len(ends) != 2 or not all(isinstance(e, str) for e in ends):
            raise ClusterError(f"{here}.nodes must name two nodes, e.g. [a, b].")
        for end in ends:
            if end not in names:
                raise ClusterError(
                    f"{here} links to node {end!r}, which the file does not define{nearest(str(end), names)}; "
                    f"nodes: {', '.join(sorted(names))}."
                )
        pairs[frozenset(ends)] = _link({k: v for k, v in spec.items() if k != "nodes"}, here)
    return links, pairs
