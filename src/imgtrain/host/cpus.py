"""The machine the process runs on: the CPUs it may use (affinity and cgroup quota), and files written so no reader
sees half of one.

No torch here: `data.shapes` generates images in pool workers that should start quickly.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

CGROUP_FILE = "/proc/self/cgroup"  # this process's cgroups (tests point these two at fake files)
CGROUP_ROOT = "/sys/fs/cgroup"


@dataclass(frozen=True)
class CpuBudget:
    """The CPUs this process may use: the affinity mask (taskset, cpusets, SLURM bindings) and the cgroup CPU
    quota (Docker's --cpus, Kubernetes' CPU limit), which often leaves the mask listing every host CPU."""

    affinity: int
    quota: float | None  # CPUs the tightest cgroup quota allows; None without one

    @property
    def usable(self) -> int:
        """Whole CPUs: the smaller of the two (a quota of 2.5 CPUs gives 2), at least 1."""
        return max(1, min(self.affinity, math.floor(self.quota))) if self.quota is not None else self.affinity

    @property
    def limited_by(self) -> str:
        """Which of the two sets `usable`, in words for the log."""
        if self.quota is not None and self.quota < self.affinity:
            return f"the cgroup CPU quota of {self.quota:g} CPUs ({self.affinity} in the affinity mask)"
        return "the CPU affinity mask"


def cpu_budget() -> CpuBudget:
    """This process's CpuBudget, read now (a quota that cannot be read counts as none)."""
    try:
        affinity = len(os.sched_getaffinity(0))
    except AttributeError:  # macOS and Windows have no sched_getaffinity
        affinity = os.cpu_count() or 1
    try:
        quota = cpu_quota(CGROUP_FILE, CGROUP_ROOT)
    except (OSError, ValueError):
        quota = None
    return CpuBudget(affinity, quota)


def available_cpus() -> int:
    """Whole CPUs this process may run on: its affinity mask, bounded by its cgroup CPU quota."""
    return cpu_budget().usable


def parse_cpu_max(text: str) -> float | None:
    """CPUs a cgroup v2 `cpu.max` ("200000 100000", or "max 100000") allows; None without a quota."""
    quota, period = (text.split() + ["100000"])[:2]
    return None if quota == "max" else int(quota) / int(period)


def _v2_quota(directory: Path) -> float | None:
    return parse_cpu_max((directory / "cpu.max").read_text())


def _v1_quota(directory: Path) -> float | None:
    quota = int((directory / "cpu.cfs_quota_us").read_text())
    return None if quota < 0 else quota / int((directory / "cpu.cfs_period_us").read_text())


def _ancestors(root: Path, cgroup: str) -> list[Path]:
    """root/a/b, root/a, root for cgroup path /a/b: a parent's quota bounds its children too."""
    parts = [p for p in cgroup.strip().split("/") if p]
    return [root.joinpath(*parts[:n]) for n in range(len(parts), -1, -1)]


def _quota_or_none(read: Callable[[Path], float | None], directory: Path) -> float | None:
    try:
        return read(directory)
    except (OSError, ValueError):  # no such controller file at this level
        return None


def cpu_quota(cgroup_file: str = CGROUP_FILE, root: str = CGROUP_ROOT) -> float | None:
    """CPUs this process's cgroup may use (cgroup v2 cpu.max, v1 cpu.cfs_quota_us); the tightest along the
    hierarchy, None when no quota is set (or there are no cgroups)."""
    quotas: list[float | None] = []
    for line in Path(cgroup_file).read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        if controllers == "":  # cgroup v2: one hierarchy at root
            quotas += [_quota_or_none(_v2_quota, d) for d in _ancestors(Path(root), path)]
        elif "cpu" in controllers.split(","):  # cgroup v1: the cpu controller's own mount
            for mount in ("cpu", "cpu,cpuacct", "cpuacct,cpu"):
                quotas += [_quota_or_none(_v1_quota, d) for d in _ancestors(Path(root) / mount, path)]
    found = [q for q in quotas if q is not None]
    return min(found) if found else None
