"""``tessera train``'s launcher: torchrun started safely, watched, and its failure told in the rank's own words.

- One machine: the rendezvous goes through a file store in a private folder, and the ranks'
  store and gloo/NCCL sockets bind to loopback (127.0.0.1, ``lo``): nothing listens on the
  network. Several machines: the rendezvous endpoint, ``--local-addr`` (the address the ranks'
  store listens on, see :func:`tessera.distributed.init`) and GLOO/NCCL_SOCKET_IFNAME are the user's.
- The ranks report how they ended into that folder (:mod:`tessera.launch.failures`). When one
  fails, ranks of the same attempt still alive a few seconds later (stopped, hung) are killed,
  instead of torchrun's fixed 30 s wait, so the job ends soon after the first failure.
- A failed job prints one ``tessera: error:`` paragraph, the root cause first (a rank's own error
  over the collective timeouts it caused in the others), and keeps the full tracebacks and
  torchrun's output in ``RUN_DIR/logs/failure-*.log``.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from tessera.launch.failures import (
    EXIT_COLLECTIVE_TIMEOUT,
    EXIT_INTERRUPTED,
    EXIT_RUNTIME_FAULT,
    REPORT_DIR_ENV,
    RankReport,
    read_reports,
)
from tessera.launch.rundir import RUN_ID_ENV, new_run_id
from tessera.launch.torchrun import BACKEND as BOUND_RENDEZVOUS
from tessera.lifetime import dies_with_parent, signal_name, termination_unwinds
from tessera.testbed.testbed import ENTER_SCRIPT

TORCHRUN = [sys.executable, "-m", "tessera.launch.torchrun"]  # torchrun, its rendezvous store bound (see there)
KILL_GRACE_S = 3.0  # after a rank fails, how long the others get to end before they are killed
POLL_S = 0.25


@dataclass
class Launch:
    """What to launch: the rank command's arguments and torchrun's layout."""

    rank_args: list[str]
    run_dir: Path
    nproc: int
    nnodes: int = 1
    max_restarts: int = 0
    rdzv_endpoint: str = ""
    rdzv_id: str = "tessera"
    local_addr: str = ""  # several machines: the address this node's ranks listen on (torchrun --local-addr)
    module: str = "tessera.train.run"  # what each rank runs (tessera.planner.live.job for a profile)
    testbed_seats: Path | None = None  # one machine, played as a cluster: each rank takes its seat first
    testbed_master_addr: str = "127.0.0.1"  # where rank 0 serves the store then (its node's namespace address)
    env: dict[str, str] | None = None  # set for this job's ranks (fault-tolerant groups: which group, the Lighthouse)
    label: str = ""  # named in its error paragraph ("group 1"), when several jobs run side by side


def _torchrun_command(job: Launch, folder: Path) -> list[str]:
    cmd = [*TORCHRUN, f"--nproc-per-node={job.nproc}", f"--max-restarts={job.max_restarts}"]
    if job.nnodes > 1 or job.rdzv_endpoint:
        cmd += [
            f"--nnodes={job.nnodes}",
            f"--rdzv-backend={BOUND_RENDEZVOUS}",  # c10d, listening on the endpoint address only
            f"--rdzv-endpoint={job.rdzv_endpoint}",
            f"--rdzv-id={job.rdzv_id}",
            *([f"--local-addr={job.local_addr}"] if job.local_addr else []),
        ]
    else:  # one machine: a file-store rendezvous (no listening socket) and loopback for the ranks
        cmd += [
            "--nnodes=1",
            "--rdzv-backend=c10d",
            f"--rdzv-endpoint={folder / 'rendezvous'}",
            "--rdzv-conf=store_type=file",
            f"--local-addr={job.testbed_master_addr if job.testbed_seats else '127.0.0.1'}",
        ]
    if job.testbed_seats is not None:  # the seat-taking script execs the rank in its cgroup and namespace
        return [*cmd, str(ENTER_SCRIPT), str(job.testbed_seats), job.module, *job.rank_args]
    return [*cmd, "-m", job.module, *job.rank_args]


def _environment(job: Launch, folder: Path) -> dict[str, str]:
    env = {
        **os.environ,
        REPORT_DIR_ENV: str(folder),
        RUN_ID_ENV: os.environ.get(RUN_ID_ENV) or new_run_id(),
        "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1",  # reliable restarts (design brief, trap 3)
        **(job.env or {}),
    }
    if job.nnodes == 1 and not job.rdzv_endpoint:
        env.setdefault("GLOO_SOCKET_IFNAME", "lo")
        env.setdefault("NCCL_SOCKET_IFNAME", "lo")
    return env


# ------------------------------------------------------------------------ watching the ranks
def _alive(pid: int) -> str | None:
    """The process state letter (R, S, T stopped, ...), or None when it is gone or a zombie."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        try:
            os.kill(pid, 0)
        except OSError:
            return None
        return "?"
    return None if state in ("Z", "X") else state


def _registered(folder: Path) -> dict[tuple[int, int], int]:
    """(attempt, rank) -> pid of every rank that started."""
    out = {}
    for path in folder.glob("rank*.*.pid"):
        rank, attempt = path.name[4:].split(".")[:2]
        try:
            out[(int(attempt), int(rank))] = int(path.read_text())
        except ValueError:
            continue
    return out


RANK_MODULES = (b"tessera.train.run", b"tessera.planner.live.job")


def is_rank(pid: int) -> bool:
    """Whether ``pid`` runs a rank (``python ... -m tessera.train.run`` or the profiler's job; not torchrun,
    whose arguments name it too, nor a process that reused the number)."""
    try:
        args = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return False
    return any(a == b"-m" and b in RANK_MODULES for a, b in zip(args, args[1:])) and not any(
        a == b"-m" and b in (b"tessera.launch.torchrun", b"torch.distributed.run") for a, b in zip(args, args[1:])
    )


class Watcher:
    """Notices the first failure of each attempt and, after a grace, kills the ranks that did not end."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.failed_at: dict[int, float] = {}  # attempt -> when its first failure was seen
        self.killed: list[tuple[int, int, str]] = []  # (attempt, rank, state) of ranks we ended
        self.vanished: set[tuple[int, int]] = set()  # (attempt, rank) gone without a report or a clean end

    def poll(self) -> None:
        pids = _registered(self.folder)
        ended = {(attempt, rank) for attempt, rank, _ in self.killed}
        failed_attempts = {r.attempt for r in read_reports(self.folder)}
        for (attempt, rank), pid in pids.items():
            done = (self.folder / f"rank{rank}.{attempt}.done").exists()
            reported = (self.folder / f"rank{rank}.{attempt}.json").exists()
            if not done and not reported and (attempt, rank) not in ended and _alive(pid) is None:
                self.vanished.add((attempt, rank))  # gone without a word: crashed or killed
                failed_attempts.add(attempt)
        now = time.monotonic()
        for attempt in failed_attempts:
            self.failed_at.setdefault(attempt, now)
            if now - self.failed_at[attempt] < KILL_GRACE_S:
                continue
            for (a, rank), pid in pids.items():
                state = _alive(pid) if a == attempt and (a, rank) not in ended else None
                if state is None or not is_rank(pid):
                    continue
                try:
                    os.kill(pid, signal.SIGKILL)  # works on a stopped process, unlike torchrun's SIGTERM
                except ProcessLookupError:
                    continue
                self.killed.append((attempt, rank, "stopped" if state in ("T", "t") else "not ending"))


def _wait(proc: subprocess.Popen, watcher: Watcher) -> int:
    while proc.poll() is None:
        watcher.poll()
        time.sleep(POLL_S)
    return proc.returncode


# ------------------------------------------------------------------------ telling the user
def _root_cause(reports: list[RankReport]) -> RankReport | None:
    """The failing rank's own report: the last attempt's, a real error before the timeouts it caused."""
    if not reports:
        return None
    last = max(r.attempt for r in reports)
    mine = [r for r in reports if r.attempt == last]
    causes = [r for r in mine if r.code != EXIT_COLLECTIVE_TIMEOUT] or mine
    return causes[0]


def _write_log(job: Launch, folder: Path, reports: list[RankReport], torchrun_log: Path) -> Path:
    """Every rank's traceback and torchrun's output, in the run's logs/ (else in the private folder)."""
    text = [f"tessera train failed at {time.strftime('%Y-%m-%d %H:%M:%S')}\n"]
    for r in reports:
        text.append(f"\n===== rank {r.rank}, attempt {r.attempt}, exit {r.code}: {r.message}\n{r.traceback}")
    text.append("\n===== torchrun output\n" + torchrun_log.read_text(errors="replace"))
    for target in (job.run_dir / "logs", folder):
        try:
            target.mkdir(parents=True, exist_ok=True)
            path = target / f"failure-{time.strftime('%Y%m%d-%H%M%S')}.log"
            path.write_text("".join(text))
            return path
        except OSError:
            continue
    return torchrun_log


def _explain(job: Launch, folder: Path, watcher: Watcher, torchrun_log: Path) -> tuple[int, str]:
    reports = read_reports(folder)
    cause = _root_cause(reports)
    log = _write_log(job, folder, reports, torchrun_log)
    last = max([r.attempt for r in reports] + [a for a, _ in watcher.vanished], default=0)
    silent = sorted(rank for a, rank in watcher.vanished if a == last)
    silent_text = f"rank{'s' if len(silent) > 1 else ''} {', '.join(map(str, silent))}"
    if silent and (cause is None or cause.peer_lost):  # a rank died first, the others lost its connection
        code = EXIT_RUNTIME_FAULT
        message = (
            f"{silent_text} ended without reporting an error (killed by a signal, the out-of-memory killer, or a "
            "crash outside Python)" + (f"; then {cause.message}" if cause is not None else ".")
        )
    elif cause is not None:
        code, message = cause.code, cause.message
        if silent:  # ended after the cause: torchrun stopped them
            message = message.rstrip(".") + f". Then {silent_text} ended without a report (stopped by torchrun)."
    else:
        started = sorted({rank for (_, rank) in _registered(folder)})
        tail = [line for line in torchrun_log.read_text(errors="replace").splitlines() if line.strip()][-3:]
        code = EXIT_RUNTIME_FAULT
        message = (
            f"the job failed without a rank reporting an error (ranks started: {started or 'none'}): a rank was "
            "killed (out of memory? a signal?) or torchrun could not start the ranks. torchrun said: "
            + " | ".join(t.strip() for t in tail)[-600:]
        )
    message = message.rstrip() if message.rstrip().endswith(".") else message.rstrip() + "."
    if watcher.killed:
        ended = ", ".join(f"rank {rank} ({state})" for _, rank, state in watcher.killed)
        message += f" Ended by tessera after the failure: {ended}."
    return code, f"{message} Full tracebacks: {log}"


def _stop(proc: subprocess.Popen) -> None:
    """SIGTERM torchrun's process group, then SIGKILL after 10 s."""
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(10)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    except ProcessLookupError:
        pass


def launch(job: Launch) -> int:
    """Run ``job`` under torchrun; print one paragraph and return its exit code if it fails."""
    folder = Path(tempfile.mkdtemp(prefix="tessera-job-"))  # private (0700): reports, rendezvous, logs
    torchrun_log = folder / "torchrun.log"
    watcher = Watcher(folder)
    keep_folder = False
    try:
        with torchrun_log.open("w") as err:
            proc = subprocess.Popen(
                _torchrun_command(job, folder),
                env=_environment(job, folder),
                stderr=err,
                start_new_session=True,
                preexec_fn=dies_with_parent(),  # even a SIGKILL of this launcher stops torchrun
            )
            with termination_unwinds():  # around the clean-up too: a second SIGTERM must not cut it short
                try:
                    code = _wait(proc, watcher)
                except (KeyboardInterrupt, SystemExit) as exc:
                    # Ctrl-C, or SIGTERM/SIGHUP turned into SystemExit: torchrun runs in a session of its
                    # own, so stop it here or its ranks outlive us.
                    _stop(proc)
                    label = job.label + ": " if job.label else ""
                    if isinstance(exc, SystemExit):
                        print(f"tessera: error: {label}stopped by {signal_name(exc.code)}, and so were its ranks; "
                              "continue later with --resume.", file=sys.stderr)  # fmt: skip
                        raise
                    print(f"tessera: error: {label}interrupted; continue later with --resume.", file=sys.stderr)
                    return EXIT_INTERRUPTED
        if code == 0:
            return 0
        code, message = _explain(job, folder, watcher, torchrun_log)
        keep_folder = str(folder) in message
        print(f"tessera: error: {job.label + ': ' if job.label else ''}{message}", file=sys.stderr)
        return code
    finally:
        if not keep_folder:
            shutil.rmtree(folder, ignore_errors=True)
