"""A testbed rank's seat: which device it plays and where it runs, checked against /proc.

``enter.py`` hands the seat to the rank in ``TESSERA_TESTBED_SEAT``; :func:`verify_seat` then
reads the kernel's view of the process (its cgroup, its network namespace) instead of trusting
that the move worked, and the trainer prints the result on every rank.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

from tessera.errors import TestbedError

SEAT_ENV = "TESSERA_TESTBED_SEAT"


@dataclass(frozen=True)
class Seat:
    """Where one rank runs: the device it plays, its share of the CPU, its node's namespace and address."""

    rank: int
    device: int
    node: str
    device_type: str
    cores: float
    cgroup: str  # the rank's cgroup directory
    namespace: str | None  # its node's network namespace (None: one node, this machine's own network)
    address: str
    interface: str


def current_seat() -> Seat | None:
    """This process's seat when a testbed launched it, else None."""
    text = os.environ.get(SEAT_ENV)
    return Seat(**json.loads(text)) if text else None


def verify_seat(seat: Seat, proc: Path = Path("/proc/self")) -> str:
    """Check with the kernel that this process is in ``seat``'s cgroup and namespace; describe it.

    Raises TestbedError when it is not (the rank would otherwise run at full speed, unshaped)."""
    tail = "/" + "/".join(Path(seat.cgroup).parts[-2:])  # .../tessera-xxxx/rankR
    groups = [line.split(":", 2) for line in (proc / "cgroup").read_text().splitlines()]
    cpu_groups = [path for _, controllers, path in groups if "cpu" in controllers.split(",") or not controllers]
    in_group = any(path.endswith(tail) for path in cpu_groups)
    if not in_group:
        raise TestbedError(f"testbed rank {seat.rank} is not in its cgroup {seat.cgroup} (/proc says {cpu_groups}).")
    where = "this machine's network"
    if seat.namespace is not None:
        mine, theirs = os.stat(proc / "ns" / "net").st_ino, os.stat(f"/run/netns/{seat.namespace}").st_ino
        if mine != theirs:
            raise TestbedError(f"testbed rank {seat.rank} is not in its network namespace {seat.namespace}.")
        where = f"namespace {seat.namespace} ({seat.address} on {seat.interface})"
    return (
        f"rank {seat.rank} plays device {seat.device} ({seat.node}, {seat.device_type}): "
        f"{seat.cores:.3g} of a core in {tail}, {where}"
    )
