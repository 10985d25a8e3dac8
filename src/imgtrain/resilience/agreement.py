"""What the ranks agree on once per logging window: one typed record per rank, in one CPU exchange.

Each rank fills a `WindowReport`: its throughput figures for the window, the stop signal it received, its
unreadable image reads, its first NaN step, and on rank 0 the checkpoint clock and the last write's outcome.
`exchange` sends it with one all-gather on the CPU (gloo) group, so no GPU sync, and returns the `Agreement`
that every rank then acts on, so every rank takes the same branch at the same step. `LoggingWindows` says at
which steps a window ends and runs that exchange; the loop calls it, so the ranks agree whatever measures the run.
Nothing here runs per step but `LoggingWindows.due`, an integer test.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, fields
from typing import Any, Protocol

from imgtrain.host import dist


@dataclass(frozen=True)
class WindowReport:
    """One rank's numbers for a logging window's exchange."""

    images_per_sec: float = 0.0  # this rank's steady-state window; 0 in a warm-up window
    data_wait_frac: float = 0.0  # share of the window's wall time spent waiting for batches
    step_time_ms: float = 0.0  # mean wall time per step
    gpu_util_pct: float = -1.0  # NVML's mean over the window; -1: not measured
    stop_signal: int = 0  # the first stop signal this rank received; 0: none
    unreadable: int = 0  # unreadable image reads since the last window
    first_nan_step: int = -1  # faults.nonfinite=stop: this rank's first step with a NaN/inf loss; -1: none
    checkpoint_due: bool = False  # rank 0: checkpoint.every_min has run out
    write_failed: bool = False  # rank 0: the last background checkpoint write failed


@dataclass(frozen=True)
class Agreement:
    """Every rank's reports, merged the same way on every rank."""

    images_per_sec: float  # summed over ranks
    data_wait_frac: float  # the mean over ranks
    data_wait_frac_max: float  # the slowest rank's: it bounds a DDP step
    step_time_ms: float  # the slowest rank's
    gpu_util_per_rank: list[float | None]  # None: not measured on that rank
    stop_signal: int  # a stop signal any rank received (the highest number if they differ); 0: none
    unreadable: int  # summed over ranks
    first_nan_step: int  # the earliest NaN step on any rank; 0: none (steps count from 1)
    checkpoint_due: bool
    write_failed: bool


_FIELDS = fields(WindowReport)
_TYPES = {"float": float, "int": int, "bool": bool}  # the annotations are strings (postponed evaluation)


def merge(reports: list[WindowReport]) -> Agreement:
    """The agreement of `reports`, one per rank."""
    nans = [report.first_nan_step for report in reports if report.first_nan_step >= 0]
    return Agreement(
        images_per_sec=sum(report.images_per_sec for report in reports),
        data_wait_frac=sum(report.data_wait_frac for report in reports) / len(reports),
        data_wait_frac_max=max(report.data_wait_frac for report in reports),
        step_time_ms=max(report.step_time_ms for report in reports),
        gpu_util_per_rank=[report.gpu_util_pct if report.gpu_util_pct >= 0 else None for report in reports],
        stop_signal=max(report.stop_signal for report in reports),
        unreadable=sum(report.unreadable for report in reports),
        first_nan_step=min(nans) if nans else 0,
        checkpoint_due=any(report.checkpoint_due for report in reports),
        write_failed=any(report.write_failed for report in reports),
    )


def exchange(mine: WindowReport) -> Agreement:
    """Every rank's report, in one all-gather of floats on the CPU group; the merge is the same on every rank."""
    rows = dist.all_gather_host([float(getattr(mine, field.name)) for field in _FIELDS])
    reports = [
        WindowReport(**{field.name: _TYPES[field.type](value) for field, value in zip(_FIELDS, row, strict=True)})
        for row in rows
    ]
    return merge(reports)


class Agreeing(Protocol):
    """A component whose numbers every rank must agree on (the faults, the checkpointer): its fields of each
    window's `WindowReport` out, the `Agreement` in."""

    def report(self) -> dict[str, Any]: ...

    def agree(self, agreed: Agreement) -> None: ...


class LoggingWindows:
    """Where the logging windows end, and the one exchange at each: every `every` steps
    (metrics.log_every_n_steps), at the `also_at` steps (the metrics' end of warm-up, so that steady windows start
    there) and at an epoch's end; never at or after `total_steps` (the run's end validates and saves instead)."""

    def __init__(self, every: int, total_steps: int, parties: Sequence[Agreeing], also_at: Iterable[int] = ()):
        self.every, self.total_steps, self.parties = every, total_steps, list(parties)
        self.also_at = frozenset(also_at)
        self.opened_at = 0  # the step the open window follows

    def due(self, step: int) -> bool:
        """Whether the window ends after step `step` (every rank gets the same answer: no exchange)."""
        return (step % self.every == 0 or step in self.also_at) and step < self.total_steps

    def open(self, step: int) -> bool:
        """Whether steps were taken since the last window ended (at an epoch's end: its partial window)."""
        return step > self.opened_at

    def begin(self, step: int) -> None:
        """A window opens after step `step` (an epoch's start)."""
        self.opened_at = step

    def agree(self, step: int, perf: dict[str, float]) -> Agreement:
        """The window's one CPU exchange: `perf` (the measured fields of the `WindowReport`, if any) and each
        party's fields out; each party then acts on the `Agreement` (faults: stop signal, unreadable files, NaN;
        checkpointer: clock, failed write), which is returned for the instruments."""
        fields_out = dict(perf)
        for party in self.parties:
            fields_out.update(party.report())
        agreed = exchange(WindowReport(**fields_out))
        for party in self.parties:
            party.agree(agreed)
        self.opened_at = step
        return agreed
