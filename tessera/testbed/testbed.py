"""The testbed: a cluster file played for real on this machine, with real slowness instead of sleeps.

Rank ``r`` plays the cluster device ``plan.device_of(r)``. It runs in a CPU cgroup of its own
whose quota is that device's relative speed: ``cpus × peak(device) / Σ peaks`` of all the
cluster's devices (``cpus`` is the CPU the whole cluster gets, by default all but a third of a
core kept for the launcher), so a device with half the peak computes half as fast, Python overhead,
communication and contention included. When the played devices sit on more than one node, each
node is a network namespace and each pair of nodes a veth pair shaped to the cluster file's
bandwidth (:mod:`tessera.testbed.network`); ranks of one node share its loopback.

Everything is torn down when the ``with`` block ends, however it ends: normally, by an
exception, Ctrl-C, SIGTERM or SIGHUP. A launcher killed with SIGKILL leaves its state file in
``/run/tessera-testbed``; :func:`clean_stale` (``tessera testbed clean``) removes what it left.

Example:
    >>> with Testbed(Cluster.load("cluster.yaml"), rank_devices=[0, 1, 2, 3]) as bed:
    ...     print(bed.describe())       # then launch with bed.seats_file and bed.master_addr
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
from dataclasses import asdict
from pathlib import Path
from typing import Any

from tessera.cluster.spec import Cluster
from tessera.errors import TestbedError
from tessera.lifetime import termination_unwinds
from tessera.testbed.cpu import CpuGroups, Hierarchy, find_cpu_hierarchy
from tessera.testbed.network import Network
from tessera.testbed.seat import Seat

STATE_DIR = Path("/run/tessera-testbed")
ENTER_SCRIPT = Path(__file__).with_name("enter.py")
HARNESS_CORES = 0.35  # left to the launcher and torchrun's agent when ``cpus`` is not given
UNSHAPED_GBS = 4.0  # links at least this fast are left unshaped: veth on one machine carries about this much


def default_cpus() -> float:
    """All of this process's CPUs but a third of a core for the harness."""
    return max(len(os.sched_getaffinity(0)) - HARNESS_CORES, 0.1)


def check_root() -> None:
    if os.geteuid() != 0:
        raise TestbedError(
            "the testbed needs root: it creates CPU cgroups and network namespaces. Run as root, or use --emulate "
            "(the sleep emulator) instead."
        )


class Testbed:
    """CPU quotas and shaped links for the ranks of one job; a context manager that undoes them."""

    def __init__(
        self,
        cluster: Cluster,
        rank_devices: list[int],
        cpus: float | None = None,
        dtype: str = "fp32",
        hierarchy: Hierarchy | None = None,
    ) -> None:
        self.cluster = cluster
        self.rank_devices = list(rank_devices)
        self.cpus = cpus if cpus is not None else default_cpus()
        self.name = f"tessera-{secrets.token_hex(3)}"
        self.seats_file = STATE_DIR / f"{self.name}.json"
        self._hierarchy = hierarchy
        self._groups: CpuGroups | None = None
        self._network: Network | None = None
        self._signals: contextlib.AbstractContextManager[None] = contextlib.nullcontext()
        devices = cluster.devices()
        for rank, device in enumerate(self.rank_devices):
            if not 0 <= device < len(devices):
                raise TestbedError(
                    f"rank {rank} plays cluster device {device}, but the cluster file describes {len(devices)} "
                    f"devices: launch at most {len(devices)} ranks, or describe more devices."
                )
        if self.cpus <= 0:
            raise TestbedError(f"the testbed needs a positive CPU budget (--testbed-cpus), got {self.cpus:g}.")
        self.dtype = dtype
        self.speeds = [self._speed(devices[d][2], dtype) for d in self.rank_devices]
        self.nodes = list(dict.fromkeys(devices[d][0] for d in self.rank_devices))  # in rank order

    @staticmethod
    def _speed(device_type: Any, dtype: str) -> float:
        peak = device_type.peak(dtype) or device_type.peak("fp32")
        if not peak:
            raise TestbedError(
                f"device type {device_type.name} has no {dtype} or fp32 peak: give one in the cluster file."
            )
        return peak

    # ------------------------------------------------------------------ layout
    def cores(self) -> list[float]:
        """Each rank's share of the CPU: its device's speed over the sum of *every* cluster device's, times
        the budget. A job that plays only some devices (dropping the slow ones) gets the same per-device
        quotas as one that plays them all, and leaves the rest of the budget idle."""
        total = sum(self._speed(t, self.dtype) for _, _, t in self.cluster.devices())
        return [self.cpus * s / total for s in self.speeds]

    def link_rates(self) -> dict[tuple[int, int], float]:
        """Bytes per second of each pair of nodes (indices into :attr:`nodes`), from the cluster file."""
        return {
            (i, j): self.cluster.link(a, b).bandwidth_gbs * 1e9
            for i, a in enumerate(self.nodes)
            for j, b in enumerate(self.nodes)
            if i < j
        }

    def seats(self) -> list[Seat]:
        devices = self.cluster.devices()
        cores = self.cores()
        net = self._network
        out = []
        for rank, device in enumerate(self.rank_devices):
            node = devices[device][0]
            index = self.nodes.index(node)
            cgroup = self._groups.path(rank) if self._groups is not None else Path("")
            out.append(
                Seat(
                    rank,
                    device,
                    node,
                    devices[device][2].name,
                    cores[rank],
                    str(cgroup),
                    net.namespace(index) if net else None,
                    net.address(index) if net else "127.0.0.1",
                    net.interface(index) if net else "lo",
                )
            )
        return out

    @property
    def master_addr(self) -> str:
        """The address rank 0 serves the job's store on (its node's home; loopback on one node)."""
        return self.seats()[0].address

    def describe(self) -> str:
        lines = [f"testbed {self.name}: {self.cpus:.3g} cores for {len(self.rank_devices)} ranks"]
        for seat in self.seats():
            where = f"{seat.namespace} ({seat.address})" if seat.namespace else "this machine's loopback"
            lines.append(
                f"  rank {seat.rank}: device {seat.device} ({seat.node}, {seat.device_type}), "
                f"{seat.cores:.3g} of a core, {where}"
            )
        for (i, j), rate in self.link_rates().items():
            shaped = "left unshaped (veth's own speed)" if rate >= UNSHAPED_GBS * 1e9 else "tbf"
            lines.append(f"  link {self.nodes[i]} <-> {self.nodes[j]}: {rate * 8 / 1e6:,.4g} Mbit/s, {shaped}")
        return "\n".join(lines)

    def link_traffic(self) -> str:
        """What each link has carried each way so far, from the kernel's counters (empty on one node)."""
        if self._network is None:
            return ""
        return "\n".join(
            f"  link {self.nodes[i]} -> {self.nodes[j]}: {sent:,} bytes sent (kernel counter, headers included)"
            for (i, j), sent in self._network.sent_bytes().items()
        )

    # ------------------------------------------------------------ set up / tear down
    def __enter__(self) -> Testbed:
        check_root()
        hierarchy = self._hierarchy or find_cpu_hierarchy()
        STATE_DIR.mkdir(mode=0o700, exist_ok=True)
        self._signals = termination_unwinds()  # SIGTERM and SIGHUP unwind to close() like Ctrl-C
        self._signals.__enter__()
        try:
            self._write_state(hierarchy)  # first: a crash from here on leaves something clean_stale can find
            self._groups = CpuGroups.create(self.name, self.cores(), hierarchy)
            if len(self.nodes) > 1:
                rates = {pair: (r if r < UNSHAPED_GBS * 1e9 else 0.0) for pair, r in self.link_rates().items()}
                self._network = Network.create(self.name, len(self.nodes), rates)
            self._write_state(hierarchy)
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Kill what still runs in the cgroups, delete them and the namespaces, forget the state file."""
        try:
            if self._groups is not None:
                self._groups.remove()
            if self._network is not None:
                self._network.remove()
            self.seats_file.unlink(missing_ok=True)
        finally:
            self._groups = self._network = None
            self._signals.__exit__(None, None, None)
            self._signals = contextlib.nullcontext()

    def _write_state(self, hierarchy: Hierarchy) -> None:
        state = {
            "owner_pid": os.getpid(),
            "cgroup_root": str(hierarchy.root),
            "cgroup_version": hierarchy.version,
            "name": self.name,
            "n_nodes": len(self.nodes) if len(self.nodes) > 1 else 0,
            "seats": [asdict(s) for s in self.seats()] if self._groups is not None else [],
        }
        tmp = self.seats_file.with_suffix(".tmp")
        tmp.write_text(json.dumps(state, indent=1))
        tmp.replace(self.seats_file)


def clean_stale(state_dir: Path = STATE_DIR) -> list[str]:
    """Remove the cgroups and namespaces of testbeds whose launcher is gone; return their names."""
    removed = []
    for path in sorted(state_dir.glob("tessera-*.json")) if state_dir.is_dir() else []:
        try:
            state = json.loads(path.read_text())
            owner = int(state["owner_pid"])
        except (OSError, ValueError, KeyError, TypeError):
            continue
        if _alive(owner):
            continue
        groups = CpuGroups(Hierarchy(Path(state["cgroup_root"]), int(state["cgroup_version"])), state["name"], [])
        groups.remove()
        if state.get("n_nodes"):
            Network(state["name"], int(state["n_nodes"])).remove()
        path.unlink(missing_ok=True)
        removed.append(state["name"])
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
