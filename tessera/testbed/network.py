"""Shaped links: every node of a testbed is a network namespace, every pair of nodes a veth pair
whose two ends are rate-limited by a token bucket (``tc qdisc ... tbf``).

Each namespace has one address (its *home*, 10.213.0.N) on all of its veths, and a route to
every other node's home over the veth to that node, so a socket bound to the home address
(gloo's, via ``GLOO_SOCKET_IFNAME``) reaches each peer over that pair's own link. Ranks of one
node share its namespace and talk over its loopback, unshaped, as devices of one machine do.
Latency is what veth gives (tens of microseconds): ``netem`` is not available to add more.

Example:
    >>> net = Network.create("tessera-ab12", n_nodes=2, rates={(0, 1): 6.25e6})  # 50 Mbit/s
    >>> net.namespace(1), net.address(1), net.interface(1)
    ('tessera-ab12-n1', '10.213.0.2', 'tb0')
"""

from __future__ import annotations

import json
import shutil
import subprocess
from itertools import combinations

from tessera.errors import TestbedError

MAX_NODES = 16  # a full mesh: n(n-1)/2 veth pairs
SUBNET = "10.213.0"  # inside the namespaces only: never seen by the machine's own network
BURST_S = 0.004  # bucket depth in seconds of the link's rate (at least 64 KiB): smooth, yet above timer granularity
QUEUE_LATENCY = "200ms"  # packets wait at most this long in the bucket's queue before being dropped


def _run(*args: str) -> None:
    done = subprocess.run(list(args), capture_output=True, text=True)
    if done.returncode:
        raise TestbedError(f"`{' '.join(args)}` failed: {(done.stderr or done.stdout).strip()}")


def check_tools() -> None:
    """Raise unless ``ip`` and ``tc`` (iproute2) are installed."""
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    if missing:
        raise TestbedError(
            f"the testbed's shaped links need iproute2's {' and '.join(missing)}, not found on PATH: install "
            "iproute2, put every device of the cluster file on one node (no links to shape), or use --emulate."
        )


class Network:
    """The namespaces and links of one testbed; :meth:`remove` deletes them (and every veth with them)."""

    def __init__(self, name: str, n_nodes: int) -> None:
        self.name = name
        self.n_nodes = n_nodes

    def namespace(self, node: int) -> str:
        return f"{self.name}-n{node}"

    def address(self, node: int) -> str:
        return f"{SUBNET}.{node + 1}"

    def interface(self, node: int) -> str:
        """A veth of ``node`` that carries its home address (gloo binds the address it finds there)."""
        return f"tb{1 if node == 0 else 0}"

    @classmethod
    def create(cls, name: str, n_nodes: int, rates: dict[tuple[int, int], float]) -> Network:
        """Namespaces for ``n_nodes`` nodes, fully meshed; ``rates[(i, j)]`` (i < j) in bytes per second
        (0: left unshaped)."""
        if not 2 <= n_nodes <= MAX_NODES:
            raise TestbedError(
                f"the testbed joins 2 to {MAX_NODES} nodes by shaped links, the cluster file has {n_nodes}: describe "
                "fewer nodes (each node a namespace, every pair a link)."
            )
        check_tools()
        net = cls(name, n_nodes)
        try:
            for node in range(n_nodes):
                _run("ip", "netns", "add", net.namespace(node))
                _run("ip", "-n", net.namespace(node), "link", "set", "lo", "up")
            for i, j in combinations(range(n_nodes), 2):
                net._join(i, j, rates[(i, j)])
        except TestbedError as exc:
            net.remove()
            if "Operation not permitted" in str(exc):
                raise TestbedError(
                    f"{exc} — the testbed's network namespaces need root (or CAP_NET_ADMIN): run as root, or use "
                    "--emulate (the sleep emulator)."
                ) from None
            raise
        return net

    def _join(self, i: int, j: int, rate: float) -> None:
        ns_i, ns_j, to_j, to_i = self.namespace(i), self.namespace(j), f"tb{j}", f"tb{i}"
        _run("ip", "link", "add", to_j, "netns", ns_i, "type", "veth", "peer", "name", to_i, "netns", ns_j)
        burst = max(64 * 1024, int(rate * BURST_S))
        for ns, dev, own, peer in ((ns_i, to_j, i, j), (ns_j, to_i, j, i)):
            _run("ip", "-n", ns, "addr", "add", f"{self.address(own)}/32", "dev", dev)
            _run("ip", "-n", ns, "link", "set", dev, "up")
            _run("ip", "-n", ns, "route", "add", f"{self.address(peer)}/32", "dev", dev)
            if rate <= 0:  # unshaped
                continue
            _run(
                "tc", "-n", ns, "qdisc", "add", "dev", dev, "root", "tbf",
                "rate", f"{int(rate * 8)}bit", "burst", str(burst), "latency", QUEUE_LATENCY,
            )  # fmt: skip

    def sent_bytes(self) -> dict[tuple[int, int], int]:
        """Bytes each node has sent each other over their link so far, by (from, to): the kernel's counter of
        the veth's transmit side (frames: headers included)."""
        sent = {}
        for i, j in combinations(range(self.n_nodes), 2):
            for src, dst in ((i, j), (j, i)):
                out = subprocess.run(
                    ["ip", "-n", self.namespace(src), "-j", "-s", "link", "show", "dev", f"tb{dst}"],
                    capture_output=True,
                    text=True,
                )
                try:
                    sent[(src, dst)] = int(json.loads(out.stdout)[0]["stats64"]["tx"]["bytes"])
                except (ValueError, LookupError, TypeError):
                    where = f"link tb{dst} in {self.namespace(src)}"
                    raise TestbedError(f"cannot read the counters of {where}: {out.stderr.strip()}") from None
        return sent

    def remove(self) -> None:
        """Delete the namespaces (their veths go with them); missing ones are skipped."""
        for node in range(self.n_nodes):
            subprocess.run(["ip", "netns", "del", self.namespace(node)], capture_output=True)
