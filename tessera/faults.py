"""Fault injection for tests, read from one environment variable in one place.

``TESSERA_FAULT`` takes one of:
    RANK:STEP                  that rank exits just before training step STEP (no report: a crash)
    hang:RANK:STEP:SECONDS     that rank stalls SECONDS before step STEP
    meet:RANK:STEP:N:FOLDER    that rank waits before step STEP until N processes have reached this point
                               (each leaves a file in FOLDER): groups started apart start together
    stop:RANK:STEP             that rank stops itself (SIGSTOP) before step STEP, as a frozen process would
    raise:RANK:STEP            that rank raises a RuntimeError before step STEP (an unexpected error)
    save:STEP                  every rank exits midway through saving the step-STEP checkpoint
Prefixed ``groupG:`` (e.g. ``group1:0:5``), a fault fires only in group G of fault-tolerant Plan.groups
(each group is its own job, with its own rank 0). Several faults: separated by commas.
Faults fire on the first attempt only, so a torchrun restart runs clean.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import torch.distributed as dist


def _specs() -> list[str]:
    """The faults meant for this process (its group's, under fault-tolerant Plan.groups)."""
    if os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0":
        return []
    mine = []
    for spec in filter(None, os.environ.get("TESSERA_FAULT", "").split(",")):
        if spec.startswith("group"):
            head, _, spec = spec.partition(":")
            if head != f"group{os.environ.get('TESSERA_GROUP', '')}":
                continue
        mine.append(spec)
    return mine


def before_step(step: int) -> None:
    """Kill, stall, stop or fail this rank before ``step`` when TESSERA_FAULT asks for it."""
    rank = dist.get_rank()
    for spec in _specs():
        if spec == f"{rank}:{step}":
            os._exit(13)
        if spec.startswith(f"hang:{rank}:{step}:"):
            time.sleep(float(spec.split(":")[3]))
        if spec.startswith(f"meet:{rank}:{step}:"):
            count, folder = spec.split(":", 4)[3:]
            meet(int(count), Path(folder))
        if spec == f"stop:{rank}:{step}":
            os.kill(os.getpid(), signal.SIGSTOP)
        if spec == f"raise:{rank}:{step}":
            raise RuntimeError(f"injected fault (TESSERA_FAULT={spec})")


def meet(count: int, folder: Path, timeout_s: float = 300.0) -> None:
    """Leave this process's mark in ``folder`` and wait until ``count`` processes have left theirs: processes
    started apart (tests' groups) go on together. RuntimeError after ``timeout_s``."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"group{os.environ.get('TESSERA_GROUP', '')}-{os.getpid()}").touch()
    deadline = time.monotonic() + timeout_s
    while len(list(folder.iterdir())) < count:
        if time.monotonic() > deadline:
            raise RuntimeError(f"meeting in {folder}: {count} processes never arrived")
        time.sleep(0.05)


def during_save(step: int) -> None:
    """Exit midway through the step-``step`` save when TESSERA_FAULT=save:STEP."""
    if f"save:{step}" in _specs():
        os._exit(17)
