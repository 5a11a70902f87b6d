"""Run a function on N real ranks (spawned processes, gloo), for tests and benchmarks.

Example:
    >>> def work(x):                      # must be importable (module level)
    ...     import torch.distributed as dist
    ...     return dist.get_rank() * x
    >>> run_ranks(work, 2, 10)
    [0, 10]
"""

from __future__ import annotations

import os
import socket
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# Ranks fork from a server process that imported these once, instead of each importing torch afresh
# (spawn): a 2-rank launch costs ~0.1 s instead of ~2.5 s on this 2-core machine.
PRELOAD = ("torch", "torch.distributed", "tessera", "tessera.testing", "tessera.train.trainer")


def _context() -> Any:
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(list(PRELOAD))
    return ctx


def _rank_entry(
    fn: Callable[..., Any],
    rank: int,
    world: int,
    port: int,
    out_dir: str,
    args: tuple,
    timeout_s: float,
    environ: dict[str, str],
) -> None:
    os.environ.clear()  # the caller's environment now, as spawn would give it (not the server's, from its start)
    os.environ.update(environ)
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world),
    )
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # one machine: nothing listens beyond loopback
    if torch.cuda.device_count() < world:
        os.environ["TESSERA_DEVICE"] = "cpu"  # NCCL needs a GPU per rank: fall back to CPU/gloo
    torch.set_num_threads(1)  # several ranks share two cores: avoid oversubscription
    out = Path(out_dir) / f"rank{rank}.pt"
    try:
        import tessera

        tessera.init(timeout_s=timeout_s)
        result = fn(*args)
        torch.save({"ok": result}, out)
    except BaseException:  # report everything, including SystemExit, to the parent
        torch.save({"error": traceback.format_exc()}, out)
        raise SystemExit(1) from None
    finally:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()


FAILED_GRACE_S = 5.0  # beyond the collective timeout, for the ranks left when one failed to write their report


def run_ranks(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout_s: float = 180.0,
    collective_timeout_s: float | None = None,
) -> list[Any]:
    """Run ``fn(*args)`` on ``world_size`` gloo ranks; return each rank's result in rank order.

    A rank that raises makes this raise with that rank's traceback; ranks still
    running after ``timeout_s`` are killed and a TimeoutError names them
    (a hung collective fails the test instead of hanging CI). Once a rank has failed, the
    others get ``collective_timeout_s`` and a few seconds more to report their own errors
    (their collectives with it time out by then), and are killed after that. Collectives inside the ranks
    time out after ``collective_timeout_s`` (default: half of ``timeout_s``).
    """
    collective_timeout_s = collective_timeout_s or timeout_s / 2
    ctx = _context()
    port = free_port()
    environ = dict(os.environ)
    with tempfile.TemporaryDirectory(prefix="tessera-ranks-") as out_dir:
        procs = [
            ctx.Process(
                target=_rank_entry,
                args=(fn, r, world_size, port, out_dir, args, collective_timeout_s, environ),
                daemon=True,
            )
            for r in range(world_size)
        ]
        for p in procs:
            p.start()
        deadline = time.monotonic() + timeout_s
        while any(p.is_alive() for p in procs) and time.monotonic() < deadline:
            if any(p.exitcode not in (None, 0) for p in procs):  # a rank failed: the others can only wait for it
                deadline = min(deadline, time.monotonic() + collective_timeout_s + FAILED_GRACE_S)
            alive = [p for p in procs if p.is_alive()]  # the last may end between the check above and here
            if alive:
                alive[0].join(0.1)
        hung = [r for r, p in enumerate(procs) if p.is_alive()]
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
        results, errors = [], []
        for r in range(world_size):
            path = Path(out_dir) / f"rank{r}.pt"
            record = torch.load(path, weights_only=False) if path.exists() else {"error": None}
            if "error" in record:
                errors.append((r, record["error"]))
            results.append(record.get("ok"))
        failed = [(r, tb) for r, tb in errors if tb]
        if failed:
            report = "\n".join(f"--- rank {r}:\n{tb}" for r, tb in failed)
            raise RuntimeError(
                f"ranks {[r for r, _ in failed]} of {world_size} failed running {fn.__name__}:\n{report}"
            )
        if hung:
            raise TimeoutError(
                f"ranks {hung} of {world_size} were still running {fn.__name__} after {timeout_s:.0f}s "
                "(a collective probably waited for a rank that never arrived); they were killed."
            )
        if errors:
            raise RuntimeError(
                f"ranks {[r for r, _ in errors]} of {world_size} exited without a result running {fn.__name__}."
            )
        return results
