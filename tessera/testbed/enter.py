"""A testbed rank takes its seat, then becomes the real rank: ``python enter.py SEATS MODULE ARGS...``.

torchrun starts this script (by path, so the ``tessera`` package, and torch with it, is not
imported twice under a small CPU quota) for every rank. It reads the rank's seat from the
SEATS file the :class:`~tessera.testbed.Testbed` wrote, moves itself into the seat's cgroup
and network namespace, takes its node's name as host name, points gloo at the namespace's interface, and executes
``python -m MODULE ARGS...`` in its place: same process, so torchrun watches the real rank.
Standard library only, on purpose.
"""

from __future__ import annotations

import ctypes
import json
import os
import sys

CLONE_NEWNET = 0x40000000
CLONE_NEWUTS = 0x04000000


def take_seat(seat: dict) -> None:
    """Move this process into ``seat``'s cgroup and network namespace, named as its node (as root)."""
    with open(os.path.join(seat["cgroup"], "cgroup.procs"), "w") as procs:
        procs.write(str(os.getpid()))
    if seat.get("namespace"):
        libc = ctypes.CDLL(None, use_errno=True)
        fd = os.open(f"/run/netns/{seat['namespace']}", os.O_RDONLY)
        try:
            if libc.setns(fd, CLONE_NEWNET) != 0:
                err = ctypes.get_errno()
                raise OSError(err, f"setns into network namespace {seat['namespace']}: {os.strerror(err)}")
        finally:
            os.close(fd)
        # The node's host name too, as a rank on a real cluster has its machine's: the traffic counters class
        # links by host name (a namespace of its own, so the machine's stays as it is).
        name = seat["node"].encode()
        if libc.unshare(CLONE_NEWUTS) != 0 or libc.sethostname(name, len(name)) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"a host name for node {seat['node']}: {os.strerror(err)}")
    os.environ["GLOO_SOCKET_IFNAME"] = seat["interface"]
    os.environ["TESSERA_TESTBED_SEAT"] = json.dumps(seat)  # tessera.testbed.seat: checked and printed by the rank


def main(argv: list[str]) -> None:
    if len(argv) < 2:
        raise SystemExit("usage: enter.py SEATS_FILE MODULE [ARGS...]")
    seats_file, module, *rest = argv
    with open(seats_file) as f:
        seats = json.load(f)["seats"]
    rank = int(os.environ["RANK"])
    if rank >= len(seats):
        raise SystemExit(f"testbed: rank {rank} has no seat: the testbed was set up for {len(seats)} ranks.")
    take_seat(seats[rank])
    os.execv(sys.executable, [sys.executable, "-m", module, *rest])


if __name__ == "__main__":
    main(sys.argv[1:])
