"""The machine the process runs on: the CPUs it may use (affinity and cgroup quota), and files written so no reader
sees half of one.

No torch here: `data.shapes` generates images in pool workers that should start quickly.
"""

from __future__ import annotations

import json
import math
import os
import secrets
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

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


def fsync_dir(directory: Path) -> None:
    """Make a rename inside `directory` durable."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write(
    path: Path,
    write: Callable[[IO[bytes]], None],
    *,
    durable: bool = False,
    check: Callable[[Path], None] | None = None,
    before_replace: Callable[[], None] | None = None,
) -> None:
    """Write `path` so that readers see the old file or the complete new one, never a partial one.

    `write` fills a temporary file in the same directory (so the final rename is atomic). `durable` fsyncs
    the file and the directory; `check` may raise to keep the old file; `before_replace` runs just before
    the rename (checkpoints keep the previous file there).

    The directory may be writable by others (a shared project folder) and the pid is in the lock file, so the
    temporary name is random and created with O_EXCL | O_NOFOLLOW: a file or symlink planted at a name
    is never written through. It stays `.{name}.*.tmp`, the name CheckpointStore clears after a crash.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
    for attempt in range(10):  # a name taken (64 random bits: only by a plant that guessed it): another one
        tmp = path.with_name(f".{path.name}.{secrets.token_hex(8)}.tmp")
        try:
            fd = os.open(tmp, flags, 0o666)  # the umask applies, as with open(): as readable as before
            break
        except FileExistsError:
            if attempt == 9:
                raise
    replaced = False
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            if durable:
                f.flush()
                os.fsync(f.fileno())
        if check is not None:
            check(tmp)
        if before_replace is not None:
            before_replace()
        os.replace(tmp, path)
        replaced = True  # from here the name is free again: whatever appears there is not ours to remove
        if durable:
            fsync_dir(path.parent)
    finally:
        if not replaced:
            tmp.unlink(missing_ok=True)


def write_json(path: Path, payload: dict[str, Any]) -> None:
    """Write JSON atomically (temporary file, then rename)."""
    text = json.dumps(payload, indent=2, default=str) + "\n"
    atomic_write(path, lambda f: f.write(text.encode()))
