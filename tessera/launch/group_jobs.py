"""``tessera train`` for fault-tolerant ``Plan.groups``: a Lighthouse, and one torchrun job per group.

One machine (``tessera train CONFIG --nproc N``): this process starts a torchft Lighthouse bound to
``--lighthouse-bind`` (loopback by default) and runs ``tessera train CONFIG --group G --lighthouse
ADDRESS`` for each group, side by side, N / count ranks each. A group whose job fails does not stop
the others; with ``--max-restarts`` its torchrun starts it again and it rejoins at the next outer sync.

Several machines: start ``tessera lighthouse --bind HOST:PORT`` somewhere every group can reach, then
on each group's machines ``tessera train CONFIG --group G --lighthouse http://HOST:PORT`` (with the
usual ``--nnodes``/``--rdzv-endpoint`` when a group spans machines).

Each group writes its own run directory, ``RUN_DIR/group_<G>`` (metrics, checkpoints, logs).
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time

from tessera import log
from tessera.across.lighthouse import (
    GROUP_ENV,
    LIGHTHOUSE_ENV,
    check_reachable,
    lighthouse_address,
    start_lighthouse,
)
from tessera.config import Config, ConfigError
from tessera.launch.jobs import Launch, launch
from tessera.lifetime import dies_with_parent, termination_unwinds
from tessera.plan.groups import Groups


def group_run_args(rank_args: list[str], cfg: Config, group: int) -> list[str]:
    """The rank command's arguments for one group: its own run directory under the run's."""
    return [*rank_args, f"--set=logging.out_dir={cfg.run_dir}", f"--set=logging.run_name=group_{group}"]


def launch_one_group(
    args: argparse.Namespace, cfg: Config, rank_args: list[str], handed: dict[str, str] | None = None
) -> int:
    """This machine's part of group ``args.group``: a torchrun job like any other, told its group and
    the Lighthouse (and handed what the launcher's checks made for its ranks)."""
    if not args.lighthouse:
        raise ConfigError("--group runs one group of fault-tolerant Plan.groups: give --lighthouse http://HOST:PORT.")
    check_reachable(args.lighthouse)
    job = Launch(
        group_run_args(rank_args, cfg, args.group),
        cfg.run_dir / f"group_{args.group}",
        nproc=args.nproc,
        nnodes=args.nnodes,
        max_restarts=args.max_restarts,
        rdzv_endpoint=args.rdzv_endpoint,
        rdzv_id=f"{args.rdzv_id}-group{args.group}",
        local_addr=args.local_addr,
        env={**(handed or {}), GROUP_ENV: str(args.group), LIGHTHOUSE_ENV: args.lighthouse},
        label=f"group {args.group}",
    )
    return launch(job)


def launch_groups_here(args: argparse.Namespace, groups: Groups) -> int:
    """Every group on this machine: a Lighthouse, then one ``tessera train --group G`` per group."""
    worlds = groups.group_worlds(args.nproc)  # checked by the preflight already
    server = start_lighthouse(args.lighthouse_bind)
    address = lighthouse_address(server, args.lighthouse_bind)
    sizes = f"of {worlds[0]} rank(s)" if len(set(worlds)) == 1 else f"of {', '.join(map(str, worlds))} ranks"
    log.get("launch").info(
        f"tessera: Lighthouse at {address}; {groups.count} groups {sizes}, each its own job "
        "(a group that fails leaves the others training)"
    )
    children: list[subprocess.Popen] = []
    with termination_unwinds():  # around the clean-up too: a second SIGTERM must not cut it short
        try:
            for group in range(groups.count):
                command = [
                    sys.executable, "-m", "tessera.cli", "train", args.config,
                    *(f"--set={o}" for o in args.overrides),
                    "--nproc", str(worlds[group]), "--group", str(group), "--lighthouse", address,
                    "--max-restarts", str(args.max_restarts), *(["--overwrite"] if args.overwrite else []),
                ]  # fmt: skip
                # a SIGKILL of this process SIGTERMs each child, which then stops its own torchrun
                children.append(subprocess.Popen(command, env={**os.environ}, preexec_fn=dies_with_parent()))
            codes = [child.wait() for child in children]
        except (KeyboardInterrupt, SystemExit) as exc:
            # Ctrl-C reached the children too (one process group): each stops its own torchrun. A SIGTERM or
            # SIGHUP came to this process alone: pass it on.
            if isinstance(exc, SystemExit):
                for child in children:
                    child.send_signal(signal.SIGTERM)
            deadline = time.monotonic() + 15
            for child in children:
                try:
                    child.wait(max(0.1, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    child.send_signal(signal.SIGTERM)
            for child in children:
                try:
                    child.wait(30)
                except subprocess.TimeoutExpired:
                    child.kill()  # its torchrun still gets SIGTERM: it dies with its parent
            raise
        finally:
            server.shutdown()
    failed = [f"group {g} (exit {code})" for g, code in enumerate(codes) if code]
    if failed:
        print(f"tessera: error: {', '.join(failed)} failed; the others ran to the end.", file=sys.stderr)
        return max(codes)
    return 0


def serve_lighthouse(bind: str, min_groups: int, heartbeat_timeout_s: float, join_timeout_s: float) -> int:
    """``tessera lighthouse``: serve until interrupted."""
    server = start_lighthouse(
        bind,
        min_groups=min_groups,
        join_timeout_ms=int(join_timeout_s * 1000),
        heartbeat_timeout_ms=int(heartbeat_timeout_s * 1000),
    )
    print(f"tessera: Lighthouse at {lighthouse_address(server, bind)} (Ctrl-C stops it)", flush=True)
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        return 0
    finally:
        server.shutdown()
