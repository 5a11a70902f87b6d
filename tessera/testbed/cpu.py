"""CPU quotas: every rank of a testbed in a cgroup of its own, held to a fraction of a core.

The kernel's CFS bandwidth control gives a cgroup ``quota`` microseconds of CPU per ``period``;
a rank with 0.3 of a core really computes 30% as fast, Python overhead and all. A short period
(10 ms) spreads the throttling over each step instead of stalling a rank for long stretches.
cgroup v1 (``cpu.cfs_quota_us``/``cpu.cfs_period_us``) and v2 (``cpu.max``) are both handled.

Example:
    >>> groups = CpuGroups.create("tessera-ab12", [0.6, 0.3])   # as root
    >>> groups.join(0, os.getpid()); ...; groups.remove()
"""

from __future__ import annotations

import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path

from tessera.errors import TestbedError

PERIOD_US = 10_000  # short: throttling spread over each step
MIN_QUOTA_US = 1_000  # the kernel refuses a smaller quota


@dataclass(frozen=True)
class Hierarchy:
    """Where the cpu controller is mounted and which cgroup version it speaks."""

    root: Path
    version: int  # 1 or 2


def find_cpu_hierarchy(mounts: Path = Path("/proc/mounts")) -> Hierarchy:
    """The cpu controller's hierarchy (v1 preferred, where it is bound), or a TestbedError saying why not."""
    try:
        lines = mounts.read_text().splitlines()
    except OSError as exc:
        raise TestbedError(f"cannot read {mounts} to find the cgroup cpu controller ({exc.strerror}).") from None
    v2 = None
    for line in lines:
        fields = line.split()
        if len(fields) < 4:
            continue
        path, kind, options = Path(fields[1]), fields[2], fields[3].split(",")
        if kind == "cgroup" and "cpu" in options:
            return Hierarchy(path, 1)
        if kind == "cgroup2" and v2 is None:
            try:
                if "cpu" in (path / "cgroup.controllers").read_text().split():
                    v2 = Hierarchy(path, 2)
            except OSError:
                continue
    if v2 is not None:
        return v2
    raise TestbedError(
        "no cgroup cpu controller is mounted (neither v1 'cpu' nor v2 with 'cpu' in cgroup.controllers), so the "
        "testbed cannot make a rank slower: mount it (mount -t cgroup -o cpu cpu /sys/fs/cgroup/cpu) or use "
        "--emulate (the sleep emulator) instead."
    )


class CpuGroups:
    """One cgroup per rank under a parent named for the testbed; :meth:`remove` undoes everything."""

    def __init__(self, hierarchy: Hierarchy, name: str, cores: list[float]) -> None:
        self.hierarchy = hierarchy
        self.parent = hierarchy.root / name
        self.cores = cores

    @classmethod
    def create(cls, name: str, cores: list[float], hierarchy: Hierarchy | None = None) -> CpuGroups:
        """Make the cgroups: rank ``r`` gets ``cores[r]`` of a core."""
        for rank, share in enumerate(cores):
            if share * PERIOD_US < MIN_QUOTA_US:
                raise TestbedError(
                    f"rank {rank} would get {share:.3g} of a core, below the kernel's smallest quota "
                    f"({MIN_QUOTA_US / PERIOD_US:g} of a core at a {PERIOD_US // 1000} ms period): give the "
                    "testbed more CPU (--testbed-cpus) or a cluster whose speeds differ less."
                )
        groups = cls(hierarchy or find_cpu_hierarchy(), name, cores)
        try:
            groups.parent.mkdir()
            if groups.hierarchy.version == 2:  # children may only use controllers their parent hands down
                (groups.parent / "cgroup.subtree_control").write_text("+cpu")
            for rank, share in enumerate(cores):
                path = groups.path(rank)
                path.mkdir()
                quota = int(share * PERIOD_US)
                if groups.hierarchy.version == 1:
                    (path / "cpu.cfs_period_us").write_text(str(PERIOD_US))
                    (path / "cpu.cfs_quota_us").write_text(str(quota))
                else:
                    (path / "cpu.max").write_text(f"{quota} {PERIOD_US}")
        except PermissionError:
            groups.remove()
            raise TestbedError(
                f"cannot create cgroups under {groups.hierarchy.root} (permission denied): the testbed needs root, "
                "or use --emulate (the sleep emulator) instead."
            ) from None
        except OSError as exc:
            groups.remove()
            raise TestbedError(f"cannot set up the CPU quotas under {groups.parent}: {exc.strerror or exc}.") from None
        return groups

    def path(self, rank: int) -> Path:
        return self.parent / f"rank{rank}"

    def join(self, rank: int, pid: int) -> None:
        """Move process ``pid`` (and the threads and children it makes from now on) into rank's cgroup."""
        (self.path(rank) / "cgroup.procs").write_text(str(pid))

    def pids(self) -> list[int]:
        out: list[int] = []
        for procs in self.parent.glob("*/cgroup.procs"):
            try:
                out += [int(p) for p in procs.read_text().split()]
            except (OSError, ValueError):
                continue
        return out

    def remove(self) -> None:
        """Kill what is still inside (a cgroup with processes cannot be removed) and delete the cgroups."""
        for pid in self.pids():
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + 5.0
        while self.pids() and time.monotonic() < deadline:
            time.sleep(0.05)
        if not self.parent.exists():
            return
        for child in sorted(self.parent.glob("rank*")):
            _rmdir(child)
        _rmdir(self.parent)


def _rmdir(path: Path) -> None:
    try:
        path.rmdir()  # cgroup directories are removed with rmdir, their control files with them
    except FileNotFoundError:
        pass
    except OSError:
        # A plain directory standing in for cgroupfs (tests) holds real files: remove them first.
        for f in path.iterdir():
            if f.is_file():
                f.unlink()
        path.rmdir()
