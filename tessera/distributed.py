"""Process-group set-up: backend and device come from what the machine has.

``tessera.init()`` is called once per process (it is idempotent). Under
``torchrun`` it joins the launched job; in a plain ``python`` process it makes
a one-rank group so the same training code runs unchanged on one device.
"""

from __future__ import annotations

import datetime
import os
import socket

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from tessera.errors import PlanError


def accelerator_available() -> bool:
    """True when this process should use CUDA: a CUDA device exists and TESSERA_DEVICE is not "cpu".

    ``TESSERA_DEVICE=cpu`` keeps a job on CPU/gloo on a GPU machine, e.g. to run more test
    ranks than there are GPUs (``tessera.testing.run_ranks`` sets it then).
    """
    return os.environ.get("TESSERA_DEVICE", "auto") != "cpu" and torch.cuda.is_available()


def pick_device(requested: str = "auto", placement: tuple[int, ...] | None = None) -> torch.device:
    """The device this rank computes on: CUDA (one per local rank, or the one ``placement`` names
    for this rank) when present, else CPU."""
    if requested == "cuda" and not accelerator_available():
        raise PlanError(
            'Plan.device="cuda" but no CUDA device is available here (none found, or TESSERA_DEVICE=cpu): '
            'use device="auto" (CUDA when present, else CPU) or device="cpu".'
        )
    if requested in ("auto", "cuda") and accelerator_available():
        local = int(os.environ.get("LOCAL_RANK", "0"))
        if placement is not None:
            local = _placed_local_index(placement)
        return torch.device("cuda", local % torch.cuda.device_count())
    return torch.device("cpu")


def _placed_local_index(placement: tuple[int, ...]) -> int:
    """This rank's GPU under a planner placement.

    On one machine, the device the placement names. On several, torchrun numbers ranks machine
    by machine, so the planner keeps each node's devices on consecutive ranks in local order
    (``tessera plan`` prints each node's ``--node-rank``): the GPU is then the local rank, once
    this machine's ranks are checked to hold one node's devices in order.
    """
    rank, local = int(os.environ.get("RANK", "0")), int(os.environ.get("LOCAL_RANK", "0"))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", str(world)))
    if local_world == world:
        return placement[rank]
    block = list(placement[rank - local : rank - local + local_world])
    if block != list(range(block[0], block[0] + local_world)):
        raise PlanError(
            f"Plan.placement gives this machine's ranks {rank - local}..{rank - local + local_world - 1} the cluster "
            f"devices {block}, which are not one node's devices in order: launch each node with the --node-rank "
            "that `tessera plan` prints for it (or plan again: planner placements keep nodes together)."
        )
    return local


def default_backend() -> str:
    return "nccl" if accelerator_available() else "gloo"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init(backend: str | None = None, timeout_s: float = 600.0) -> None:
    """Join (or create) the default process group; safe to call more than once.

    Args:
        backend: ``"gloo"`` or ``"nccl"``; chosen from the machine when ``None``.
        timeout_s: how long a collective may wait for a missing peer before failing.

    Example:
        >>> import tessera
        >>> tessera.init()          # under torchrun: joins the job; alone: a 1-rank group
    """
    if dist.is_initialized():
        return
    backend = backend or default_backend()
    if backend == "nccl" and not accelerator_available():
        raise PlanError('backend="nccl" needs CUDA devices; this machine has none: use "gloo".')
    if backend == "nccl":
        torch.cuda.set_device(pick_device("cuda"))
    timeout = datetime.timedelta(seconds=timeout_s)
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":  # torchrun's agent already serves the store
        dist.init_process_group(backend=backend, timeout=timeout)
        return
    if "RANK" in os.environ:
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        addr, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    else:  # a plain single process: a one-rank group, so the same code path runs. Nothing goes into os.environ:
        # a process started from this one (a notebook's `!tessera train`) would take RANK for its own and run as
        # a rank of a job that does not exist.
        rank, world, addr, port = 0, 1, "127.0.0.1", _free_port()
    global _STORE_ADDRESS
    _STORE_ADDRESS = (addr, port)
    store = _bound_store(addr, port, rank, world, timeout)
    dist.init_process_group(backend=backend, store=store, rank=rank, world_size=world, timeout=timeout)


_STORE_ADDRESS: tuple[str, int] | None = None  # where init() served this process's job store


def store_address() -> tuple[str, int]:
    """Host and port of the job's key-value store: torchrun's MASTER_ADDR and MASTER_PORT, or, in a plain
    process, the store :func:`init` made for its one-rank group (which it does not write into os.environ)."""
    if "MASTER_ADDR" in os.environ and "MASTER_PORT" in os.environ:
        return os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    if _STORE_ADDRESS is None:
        raise PlanError("no process group yet: call tessera.init() (or build a Booster) first.")
    return _STORE_ADDRESS


def shutdown() -> None:
    """Leave the process group at the end of a rank that finished its work. Left to interpreter
    exit, gloo's threads were torn down in no particular order: on the testbed a throttled rank of
    a finished job aborted ("terminate called without an active exception", SIGABRT) and the job
    failed after the work was done."""
    if dist.is_initialized():
        dist.destroy_process_group()


def _bound_store(addr: str, port: int, rank: int, world: int, timeout: datetime.timedelta) -> dist.TCPStore:
    """The job's key-value store, its server listening on ``addr`` only.

    torch's TCPStore server listens on every interface, and the store is unauthenticated: rank 0
    binds the socket itself to the address the other ranks dial (loopback for one-machine runs,
    where ``tessera train`` sets MASTER_ADDR=127.0.0.1) and hands it to the store.
    """
    if rank != 0:
        return dist.TCPStore(addr, port, world, False, timeout=timeout)
    try:
        return serve_store_on(addr, port, timeout, world)
    except OSError as exc:
        raise PlanError(
            f"rank 0 cannot listen on MASTER_ADDR={addr} port {port} ({exc.strerror or exc}): give this machine's "
            "address (or 127.0.0.1 on one machine) and a free port."
        ) from None


def serve_store_on(
    addr: str, port: int, timeout: datetime.timedelta, world: int | None = None, multi_tenant: bool = False
) -> dist.TCPStore:
    """A TCPStore server whose socket listens on ``addr`` only (torch's own binds every interface).

    Raises OSError when ``addr``/``port`` cannot be bound (not this machine's address, port in use).
    """
    family, _, _, _, sockaddr = socket.getaddrinfo(addr, port, type=socket.SOCK_STREAM)[0]
    sock = socket.create_server(sockaddr, family=family, backlog=max(128, world or 0))
    # The store owns the listening socket from here on (detach: Python must not close it).
    return dist.TCPStore(
        addr,
        sock.getsockname()[1],
        world,
        True,
        timeout=timeout,
        multi_tenant=multi_tenant,
        master_listen_fd=sock.detach(),
        use_libuv=True,
    )


def local(t: torch.Tensor) -> torch.Tensor:
    """The part of ``t`` this rank holds: a DTensor's local shard (in-place updates of it update
    ``t``), or ``t`` itself."""
    return t.to_local() if isinstance(t, DTensor) else t
