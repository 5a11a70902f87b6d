"""torchft's Lighthouse, from the launcher's side: start one, say its address, check that one answers; and
the environment that tells each group's job its group and the Lighthouse.

The Lighthouse is one small server for a whole fault-tolerant run: every group's ranks dial it to form a
quorum at each outer sync (:mod:`tessera.across.torchft`). ``tessera train`` starts one on this machine;
``tessera lighthouse`` serves one for groups on several machines.
"""

from __future__ import annotations

import socket
import urllib.parse
from typing import Any

from tessera.errors import PlanError

LIGHTHOUSE_ENV = "TORCHFT_LIGHTHOUSE"  # where a group's ranks dial it
GROUP_ENV = "TESSERA_GROUP"  # which of Plan.groups a job is (tessera train sets it for each group's job)
JOIN_TIMEOUT_MS = 3_600_000


def check_reachable(lighthouse: str, timeout_s: float = 5.0) -> None:
    """Refuse a Lighthouse address that nothing answers on, before torchft would wait on it."""
    parsed = urllib.parse.urlparse(lighthouse if "://" in lighthouse else f"http://{lighthouse}")
    if not parsed.hostname or not parsed.port:
        raise PlanError(
            f"the Lighthouse address {lighthouse!r} needs a host and a port, e.g. http://10.0.0.1:29510 "
            "(`tessera lighthouse` prints its own)."
        )
    try:
        with socket.create_connection((parsed.hostname, parsed.port), timeout=timeout_s):
            pass
    except OSError as exc:
        raise PlanError(
            f"the Lighthouse at {lighthouse} cannot be reached ({exc.strerror or exc}): start it first "
            f"(`tessera lighthouse --bind {parsed.hostname}:{parsed.port}`) or give its address in {LIGHTHOUSE_ENV}."
        ) from None


def start_lighthouse(
    bind: str = "127.0.0.1:0",
    min_groups: int = 1,
    join_timeout_ms: int = JOIN_TIMEOUT_MS,
    heartbeat_timeout_ms: int = 5000,
) -> Any:
    """A torchft Lighthouse listening on ``bind`` (``host:port``; port 0: any free one). Its
    ``address()`` is what every group's Manager dials; ``shutdown()`` stops it.

    ``min_groups``: the fewest groups a quorum may have; ``heartbeat_timeout_ms``: how long a silent
    group counts as alive (then the others carry on without it); ``join_timeout_ms``: how long a quorum
    waits for a group that is alive but not at the sync yet. DiLoCo's groups meet every H steps and may
    differ in speed by far more than torchft's default second, so by default they wait for each other
    (an hour); a group that dies stops heartbeating and is left out within ``heartbeat_timeout_ms``."""
    from torchft._torchft import LighthouseServer

    host, _, port = bind.rpartition(":")
    if not host or not port.isdigit():
        raise PlanError(f"the Lighthouse's bind address {bind!r} must be host:port, e.g. 127.0.0.1:29510.")
    try:
        server = LighthouseServer(
            bind=bind,
            min_replicas=min_groups,
            join_timeout_ms=join_timeout_ms,
            heartbeat_timeout_ms=heartbeat_timeout_ms,
        )
    except Exception as exc:  # torchft's Rust server: a port in use, an address not on this machine
        raise PlanError(f"the Lighthouse cannot listen on {bind} ({exc}): give a free port of this machine.") from None
    return server


def lighthouse_address(server: Any, bind: str) -> str:
    """The address groups dial: the bound host (torchft advertises the machine's name) and its port."""
    port = urllib.parse.urlparse(server.address()).port
    return f"http://{bind.rpartition(':')[0]}:{port}"
