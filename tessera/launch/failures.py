"""How a training rank reports the way it ended, so the launcher can show the rank's own words.

Each rank registers its pid when it starts and, when it ends, writes one small JSON report
(exit code, one-paragraph message, full traceback) into the folder ``TESSERA_REPORT_DIR`` that
``tessera train`` made for the job. File names carry the torchrun attempt, so a restarted job's
reports never mix with the failed attempt's. Without that folder (a rank launched by torchrun
or SLURM directly) the rank prints its traceback and the paragraph to stderr instead.

Exit codes, shared by the ranks and ``tessera train``:

    0  finished
    2  bad input: config, plan, cluster file, checkpoint, paths (nothing ran, or it stopped before harm)
    3  a collective failed or timed out: a peer died, hung or never arrived (see the other ranks' reports)
    4  runtime fault: out of memory, disk full, a crashed or killed rank, an internal error
  130  interrupted (Ctrl-C)
"""

from __future__ import annotations

import errno
import json
import os
import sys
import time
import traceback
from dataclasses import asdict, dataclass
from pathlib import Path

from tessera.config import ConfigError
from tessera.errors import (
    EXIT_BAD_INPUT,
    EXIT_COLLECTIVE_TIMEOUT,
    EXIT_INTERRUPTED,
    EXIT_RUNTIME_FAULT,
    CheckpointError,
    ClusterError,
    PlanError,
    RuntimeFault,
)
from tessera.inputs import InputError

REPORT_DIR_ENV = "TESSERA_REPORT_DIR"
PEER_LOST = "lost the connection to another rank in a collective"


class CollectiveTimeout(RuntimeError):
    """A collective did not complete in time: a peer died, hung or never arrived."""


@dataclass
class RankReport:
    """How one rank of one attempt ended."""

    rank: int
    attempt: int
    code: int
    message: str
    traceback: str
    time: float
    peer_lost: bool = False  # the error is that another rank's connection closed: that rank died first


BAD_INPUT = (ConfigError, PlanError, CheckpointError, ClusterError, InputError, FileNotFoundError)


def classify(exc: BaseException) -> tuple[int, str]:
    """The exit code for ``exc`` and its message for the user (without where it happened)."""
    if isinstance(exc, KeyboardInterrupt):
        return EXIT_INTERRUPTED, "interrupted."
    if isinstance(exc, CollectiveTimeout):
        return EXIT_COLLECTIVE_TIMEOUT, str(exc)
    if isinstance(exc, RuntimeFault):
        return EXIT_RUNTIME_FAULT, str(exc)
    if isinstance(exc, BAD_INPUT):
        return EXIT_BAD_INPUT, str(exc)
    if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT):
        where = f" writing '{exc.filename}'" if exc.filename else ""
        return EXIT_RUNTIME_FAULT, f"the disk is full{where}: free space, then continue with --resume."
    if isinstance(exc, OSError) and exc.errno in (errno.EACCES, errno.EROFS, errno.EPERM):
        where = f"'{exc.filename}'" if exc.filename else "a file"
        return EXIT_BAD_INPUT, f"cannot write {where}: {exc.strerror}; choose a writable logging.out_dir."
    text = str(exc)
    if any(s in text for s in ("Connection closed by peer", "Connection reset by peer", "Broken pipe")):
        return EXIT_COLLECTIVE_TIMEOUT, PEER_LOST + (
            ": that rank died or was killed (see its report, or the log); restart with --resume to continue "
            "from the last checkpoint."
        )
    if isinstance(exc, MemoryError) or "can't allocate memory" in text or "out of memory" in text.lower():
        return EXIT_RUNTIME_FAULT, (
            f"out of memory ({type(exc).__name__}: {text.strip().splitlines()[0][:200] if text.strip() else ''}): "
            "lower model sizes, data.seq_len or the batch, or shard more (plan.zero=3, plan.offload, more ranks)."
        )
    first = text.strip().splitlines()[0][:300] if text.strip() else ""
    return EXIT_RUNTIME_FAULT, f"internal error {type(exc).__name__}: {first}"


class Reporter:
    """One rank's side of the report folder (a no-op printer when the job was not launched by ``tessera train``)."""

    def __init__(self) -> None:
        folder = os.environ.get(REPORT_DIR_ENV)
        self.folder = Path(folder) if folder else None
        self.rank = int(os.environ.get("RANK", "0"))
        self.attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))

    def _path(self, suffix: str) -> Path:
        assert self.folder is not None
        return self.folder / f"rank{self.rank}.{self.attempt}.{suffix}"

    def started(self) -> None:
        """Register this process, so the launcher can end it if it stops responding."""
        if self.folder is not None:
            self._path("pid").write_text(str(os.getpid()))

    def finished(self) -> None:
        if self.folder is not None:
            self._path("done").write_text("")

    def failed(self, exc: BaseException, where: str) -> int:
        """Report ``exc`` (raised ``where``, e.g. "step 12") and return the exit code."""
        code, message = classify(exc)
        message = f"rank {self.rank}, {where}: {message}"
        tb = "".join(traceback.format_exception(exc))
        if self.folder is None:
            print(tb, file=sys.stderr)
        else:
            report = RankReport(self.rank, self.attempt, code, message, tb, time.time(), PEER_LOST in message)
            tmp = self._path("json.tmp")
            tmp.write_text(json.dumps(asdict(report)))
            os.replace(tmp, self._path("json"))
        print(f"tessera: error: {message}", file=sys.stderr, flush=True)
        return code


def read_reports(folder: Path) -> list[RankReport]:
    """Every rank report in ``folder``, oldest first."""
    reports = []
    for path in folder.glob("rank*.json"):
        try:
            reports.append(RankReport(**json.loads(path.read_text())))
        except (ValueError, TypeError):  # a rank died while writing: no report
            continue
    return sorted(reports, key=lambda r: r.time)
