"""Exact memory of a process tree: PSS (shared pages split between the processes sharing them) and USS (pages
only this process holds), and a detector for DataLoader workers whose unique memory keeps growing.

RSS counts a page in every process that maps it, so the RSS of a training process plus its forked workers
counts the parent's memory (torch, the Dataset) once per worker. PSS divides each shared page among its
sharers, so PSS summed over the tree is what the tree really holds.

Cost, measured on a 2-core VM (2026-11-23, Linux 6.18, psutil 7.2.2): reading /proc/<pid>/smaps_rollup of a
python process that imported torch (540 MB RSS) took 18 ms, all of it kernel time spent walking page tables
(about 20 ms per GB resident: 22 ms with a 1 GB bytearray, 0.2 ms for a bare python); /proc/<pid>/smaps took
27 ms. psutil's memory_full_info() reads smaps_rollup too where it exists (17 ms here). Hence the slow,
cost-bounded cadence of TreeMemory below, on the monitor's thread only.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import time
from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass, field

import psutil

logger = logging.getLogger(__name__)

MB = 2**20
PSS_INTERVAL_S = 5.0  # at most one tree-wide PSS sample per 5 s ...
PSS_CPU_BUDGET = 0.01  # ... and never more than 1 % of one core: a 20 GB tree (~0.4 s a sample) gets ~40 s
PSS_MIN_GAP_S = 1.0  # new workers (or the end of the run) get an early sample, at least this long (and the
# budget allows) after the last
# Where PSS comes from: Linux >= 4.14 has smaps_rollup; an older Linux only smaps (psutil parses it, slower);
# macOS and Windows have no PSS at all.
HAS_SMAPS_ROLLUP = os.path.exists("/proc/self/smaps_rollup")
HAS_PSS = HAS_SMAPS_ROLLUP or psutil.LINUX


@dataclass(frozen=True)
class ProcMemory:
    """One process's proportional (pss) and unique (uss) set size, in bytes."""

    pss: int
    uss: int


def parse_smaps_rollup(text: str) -> dict[str, int]:
    """The `Name:  123 kB` fields of /proc/<pid>/smaps_rollup, in bytes (the address header line is skipped)."""
    fields: dict[str, int] = {}
    for line in text.splitlines():
        parts = line.split()
        if len(parts) >= 2 and parts[0].endswith(":") and parts[1].isdigit():
            unit = 1024 if parts[2:3] == ["kB"] else 1
            fields[parts[0][:-1]] = int(parts[1]) * unit
    return fields


def read_memory(pid: int, procfs: str = "/proc") -> ProcMemory | None:
    """PSS and USS of process `pid`; None where the platform has no PSS or the process is gone or not ours."""
    if HAS_SMAPS_ROLLUP:
        try:
            # FileIO.read releases the GIL: the kernel's page-table walk does not hold up the training thread.
            with open(f"{procfs}/{pid}/smaps_rollup", "rb") as f:
                fields = parse_smaps_rollup(f.read().decode("ascii", "replace"))
        except OSError:  # exited (ENOENT/ESRCH) or another user's (EACCES)
            return None
        if "Pss" not in fields:
            return None
        return ProcMemory(fields["Pss"], fields.get("Private_Clean", 0) + fields.get("Private_Dirty", 0))
    if not HAS_PSS:
        return None
    try:
        info = psutil.Process(pid).memory_full_info()
    except (psutil.Error, OSError):
        return None
    pss = getattr(info, "pss", None)
    return None if pss is None else ProcMemory(int(pss), int(info.uss))


def forked_children(main: psutil.Process, children: Iterable[psutil.Process]) -> set[int]:
    """Pids of the children forked from `main` without an exec (same command line): where copy-on-write applies.

    That leaves out spawn/forkserver workers, which share no pages with the main process, and helpers that run
    another program (e.g. torch.compile's compile workers), whose memory grows for reasons of their own.
    """
    try:
        own = main.cmdline()
    except psutil.Error:
        return set()
    forked = set()
    for child in children:
        with contextlib.suppress(psutil.Error):
            if child.cmdline() == own:
                forked.add(child.pid)
    return forked


@dataclass
class CowGrowthDetector:
    """Warns once when one worker's unique memory (USS) grows steadily: copy-on-write of the Dataset's objects.

    "Steadily": at least `min_samples` samples over at least `min_span_s` seconds; at least `rising_frac` of the
    steps between samples go up; and the growth, from the median of the first three samples to the
    median of the last three (so that one spike neither makes nor hides it), exceeds both `min_growth_mb` and
    `min_growth_frac` of the first value. A flat series with noise rises on about half its steps and fails.
    """

    min_samples: int = 6
    min_span_s: float = 30.0
    min_growth_mb: float = 64.0
    min_growth_frac: float = 0.2
    rising_frac: float = 0.7
    max_kept: int = 256  # per process; older samples are thinned, the first one is always kept
    warned: bool = False
    series: dict[int, list[tuple[float, int]]] = field(default_factory=dict)

    def add(self, t: float, pid: int, uss: int) -> str | None:
        """Record one sample (seconds, pid, bytes); the warning text the first time a series qualifies."""
        points = self.series.setdefault(pid, [])
        points.append((t, uss))
        if len(points) > self.max_kept:
            points[1:-1] = points[1:-1:2]  # halve the middle: the span and both ends stay
        if self.warned or not self._growing(points):
            return None
        self.warned = True
        return self._message(pid, points)

    def retain(self, pids: set[int]) -> None:
        """Forget processes that are gone (a recycled pid must not continue an old series)."""
        for pid in self.series.keys() - pids:
            del self.series[pid]

    def _growing(self, points: list[tuple[float, int]]) -> bool:
        """Whether this series is a steady rise (see the class docstring)."""
        if len(points) < self.min_samples or points[-1][0] - points[0][0] < self.min_span_s:
            return False
        values = [uss for _, uss in points]
        rising = sum(b > a for a, b in zip(values[:-1], values[1:], strict=True)) / (len(values) - 1)
        growth = _median(values[-3:]) - _median(values[:3])
        return rising >= self.rising_frac and growth > max(self.min_growth_mb * MB, self.min_growth_frac * values[0])

    @staticmethod
    def _message(pid: int, points: list[tuple[float, int]]) -> str:
        """The one warning: which worker, how much over how long, why, and the fix."""
        (t0, first), (t1, last) = points[0], points[-1]
        return (
            f"DataLoader worker pid {pid}: its unique memory (USS) grew by {(last - first) / MB:.0f} MB over "
            f"{t1 - t0:.0f} s ({first / MB:.0f} -> {last / MB:.0f} MB). This is usually "
            "copy-on-write: the workers are forked, and merely reading a Python object in the Dataset (a list or dict "
            "of str, tuples, ints) writes its reference count, so each worker copies every page holding such "
            "objects and RAM grows by about the Dataset's size per worker (pytorch/pytorch#13246). Keep per-sample "
            "data in numpy arrays or bytes instead, as imgtrain.data.datasets.ImageFileDataset does (paths as "
            "np.bytes_, labels as int64)."
        )


def _median(values: list[int]) -> float:
    """Median of a short list."""
    ordered = sorted(values)
    mid = len(ordered) // 2
    return ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2


class TreeMemory:
    """PSS of a process tree on a slow cadence bounded by its own CPU cost; feeds each child's USS to a detector.

    A sample is due on the first call, every `PSS_INTERVAL_S` after that (longer when a sample costs more than
    `PSS_CPU_BUDGET` of a core), and early (`PSS_MIN_GAP_S` after the last) when new workers appear, so short
    runs and each epoch's fresh workers are seen too.
    """

    def __init__(self, detector: CowGrowthDetector | None = None) -> None:
        self.detector = detector or CowGrowthDetector()
        self.next_at, self.last_at, self.gap = 0.0, -math.inf, PSS_MIN_GAP_S
        self.seen: set[int] = set()

    def due(self, now: float, children: Sequence[int], final: bool = False) -> bool:
        """Whether to sample now (`final`: the run is over; sample unless one was just taken)."""
        if not HAS_PSS:
            return False
        early = final or not self.seen.issuperset(children)
        return now >= self.next_at or (early and now >= self.last_at + self.gap)

    def sample(self, now: float, main_pid: int, children: Sequence[int], forked: Collection[int]) -> int | None:
        """PSS bytes of `main_pid` plus `children` (those readable); None if the main process cannot be read.
        The USS of the `forked` children goes to the copy-on-write detector."""
        started = time.thread_time()  # this thread's CPU, kernel time included: the page-table walks
        main = read_memory(main_pid)
        total = None if main is None else main.pss
        if main is not None:
            for pid in children:
                memory = read_memory(pid)
                if memory is None:  # exited since it was listed
                    continue
                total += memory.pss
                warning = self.detector.add(now, pid, memory.uss) if pid in forked else None
                if warning:
                    logger.warning(warning)
        self.detector.retain(set(forked))
        spacing = (time.thread_time() - started) / PSS_CPU_BUDGET
        self.last_at, self.seen = now, set(children)
        self.next_at, self.gap = now + max(PSS_INTERVAL_S, spacing), max(PSS_MIN_GAP_S, spacing)
        return total
