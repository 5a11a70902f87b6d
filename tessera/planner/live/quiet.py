"""Whether the machine was quiet while a live profile measured it: the CPU time other processes took.

A profile times devices by the clock. On a CPU machine, and on a GPU machine whose ranks wait on the host,
another process using the cores makes the devices look slower than they are, unevenly, and the planner then
shares work by the wrong speeds (issue 35: on a busy machine a plan lost to uniform DDP, 0.73x, with no
warning). The launcher reads the machine's busy CPU time (``/proc/stat``) and its own processes' (itself and
every child it waited for: torchrun and the ranks) before and after the profile; the rest is others'.

Example:
    >>> with CpuWatch() as watch:
    ...     run_the_profile()
    >>> watch.others_cores  # other processes' load, in cores, averaged over the profile
"""

from __future__ import annotations

import os
import resource
import time
from pathlib import Path

# Other processes' average load, in cores, above which a profile is not trusted. A quiet testbed reads up to
# 0.25: kernel threads (ksoftirqd) carrying the profile's own traffic through the shaped links count as others.
BUSY_CORES = 0.5
STAT = Path("/proc/stat")
_clock = time.monotonic  # the wall clock the watch reads (a test gives its own)


def machine_busy_s() -> float | None:
    """CPU seconds every core of this machine has spent running processes since boot (None where /proc/stat
    is missing)."""
    try:
        fields = STAT.read_text().splitlines()[0].split()
    except OSError:
        return None
    user, nice, system = (int(x) for x in fields[1:4])
    # Processes' time only: interrupts and softirqs are the kernel's work for whoever's packets they carry
    # (the profile's own, shaped between the testbed's namespaces, took a third of a core there).
    return (user + nice + system) / os.sysconf("SC_CLK_TCK")


def own_busy_s() -> float:
    """CPU seconds of this process and of every child it has waited for."""
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


class CpuWatch:
    """Other processes' CPU load over a ``with`` block (children must be waited for inside it)."""

    def __enter__(self) -> CpuWatch:
        self._start = (_clock(), machine_busy_s(), own_busy_s())
        self.wall_s = self.others_cores = 0.0
        return self

    def __exit__(self, *exc: object) -> None:
        wall0, busy0, own0 = self._start
        busy1 = machine_busy_s()
        self.wall_s = _clock() - wall0
        if busy0 is None or busy1 is None or self.wall_s <= 0:
            return
        others = (busy1 - busy0) - (own_busy_s() - own0)
        self.others_cores = max(0.0, others / self.wall_s)

    @property
    def busy(self) -> bool:
        return self.others_cores > BUSY_CORES

    def warning(self) -> str:
        return busy_warning(self.others_cores)


def busy_warning(others_cores: float) -> str:
    """The line a profile taken beside ``others_cores`` of other processes' load gets."""
    return (
        f"other processes used {others_cores:.2f} CPU cores on average while the profile measured (more than "
        f"{BUSY_CORES}): its device speeds may be wrong and uneven; measure again on a quiet machine before "
        "planning from it."
    )
