"""What ends a run early, and how: preemption signals, non-finite losses, unreadable images, DataLoader failures.

Every rank must take the same branch at a step boundary, so the loop exchanges three host-side numbers per
step (`agree`, on the CPU): a signal that reached one rank only, or a NaN on one rank, then stops or skips
on all of them.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import shutil
import signal
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import psutil
import torch

from imgtrain import dist
from imgtrain.config import DataConfig, RunError

log = logging.getLogger(__name__)

# Signals that ask for a checkpoint and a clean exit: SIGTERM (SLURM preemption and scancel, torchrun's
# agent, `kill`), SIGUSR1 (sbatch --signal=USR1@120), and submitit's own requeue signal when it set one up.
STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)
SUBMITIT_SIGNAL = signal.SIGUSR2
# A DataLoader worker that gets SIGTERM (SLURM signals every process of the job) lives this much longer, so
# the main process can reach the step boundary and save; then it exits even if nothing else stops it.
# SLURM's default KillWait is 30 s: after that everything gets SIGKILL anyway.
WORKER_GRACE_S = 30


class Preempted(BaseException):  # noqa: N818 - like KeyboardInterrupt: it ends a sweep too, not just one job
    """A stop signal arrived; the checkpoint is saved and the process exits with 128 + the signal number."""

    def __init__(self, signum: int, message: str) -> None:
        super().__init__(message)
        self.signum = signum

    @property
    def exit_code(self) -> int:
        return 128 + self.signum  # the shell's convention for "ended by this signal"; SLURM and torchrun see a failure


class StopSignals:
    """Catch stop signals during training: the handler only records them; the loop acts at a step boundary."""

    def __init__(self) -> None:
        self.received = 0  # the first signal's number; 0 = none
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> StopSignals:
        if threading.current_thread() is not threading.main_thread():
            return self  # Python delivers signals to the main thread only
        wanted = list(STOP_SIGNALS)
        if callable(signal.getsignal(SUBMITIT_SIGNAL)):  # submitit's checkpoint-and-requeue handler is installed
            wanted.append(SUBMITIT_SIGNAL)
        for signum in wanted:
            self._previous[signum] = signal.signal(signum, self._record)
        return self

    def __exit__(self, *exc: object) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous.clear()

    def _record(self, signum: int, frame: Any) -> None:
        if not self.received:
            self.received = signum
            # os.write, not logging: a signal handler must not take the logging locks the main thread may hold.
            name = signal.Signals(signum).name
            os.write(2, f"[imgtrain] {name} received: saving a checkpoint at the end of this step\n".encode())

    def hand_over(self) -> None:
        """After the checkpoint: run the handler that was there before (submitit requeues the job and exits)."""
        previous = self._previous.get(self.received)
        self.__exit__()
        if callable(previous):
            previous(self.received, None)


def worker_signals() -> None:
    """In a DataLoader worker: survive the job-wide stop signal long enough for the main process to save."""
    for signum in (signal.SIGUSR1, SUBMITIT_SIGNAL):
        signal.signal(signum, signal.SIG_IGN)  # their default action would kill the worker mid-epoch
    signal.signal(signal.SIGTERM, _worker_sigterm)


def _worker_sigterm(signum: int, frame: Any) -> None:
    # PyTorch also sends SIGTERM to a worker that did not stop when asked: the alarm still ends it, a bit later.
    remaining = signal.alarm(0)  # an alarm already running keeps its deadline
    signal.alarm(remaining or WORKER_GRACE_S)


# ----------------------------------------------------------------------------- per-step agreement
@dataclass(frozen=True)
class StepFlags:
    nonfinite: bool  # the loss was NaN or inf on at least one rank (checked every step with nonfinite=skip only)
    stop_signal: int  # a stop signal's number if any rank received one, else 0
    skipped: int  # unreadable images replaced in this step's batches, summed over ranks


def agree(loss: torch.Tensor | None, stop_signal: int, skipped: int, check_loss: bool) -> StepFlags:
    """What every rank must act on at this step boundary, exchanged on the CPU (gloo) under DDP.

    Stop signals and skipped images are host-side numbers, so this costs no GPU sync. Only with
    `check_loss` (trainer.nonfinite=skip, which must know before the update) is the loss read from the
    device every step; with stop, the loop watches for NaN on the device and reads it with the log window.
    """
    nonfinite = int(check_loss and loss is not None and not bool(torch.isfinite(loss.detach())))
    rows = dist.all_gather_host([nonfinite, stop_signal, skipped])
    return StepFlags(
        nonfinite=any(row[0] for row in rows),
        stop_signal=max(row[1] for row in rows),
        skipped=sum(row[2] for row in rows),
    )


# ----------------------------------------------------------------------------- unreadable images
class BadSampleBudget:
    """Counts unreadable images (each read counts) and stops the run once `data.max_bad_samples` is passed."""

    def __init__(self, limit: int | None, count: int = 0) -> None:
        self.limit, self.count = limit, count
        self.examples: list[str] = []

    def report(self, skipped: tuple[str, ...]) -> None:
        """Log this rank's unreadable images, with their paths."""
        for reason in skipped:
            log.warning("skipped an unreadable image: %s", reason)
            if len(self.examples) < 3:
                self.examples.append(reason)

    def add(self, count: int) -> None:
        self.count += count

    @property
    def exceeded(self) -> bool:
        return self.limit is not None and self.count > self.limit

    def error(self, checkpoint: str) -> RunError:
        shown = "; ".join(self.examples) or "see the warnings above"
        return RunError(
            f"data.max_bad_samples={self.limit} exceeded: {self.count} image reads failed (e.g. {shown}). "
            f"Fix or remove those files, or raise data.max_bad_samples (null = no limit). {checkpoint}"
        )


# ----------------------------------------------------------------------------- DataLoader failures
def next_batch(batches: Any, data: DataConfig) -> Any:
    """The next batch, or None at the end of the epoch; DataLoader failures become one line saying what to change."""
    try:
        return next(batches, None)
    except RuntimeError as error:
        explanation = explain_loader_failure(_with_exit_signals(str(error), batches), data)
        if explanation is None:
            raise
        raise RunError(explanation) from error


@contextlib.contextmanager
def workers_stopped_on_error(batches: Any) -> Iterator[Any]:
    """Yield a DataLoader iterator; if the loop ends early (error or stop signal), stop its workers politely now.

    Otherwise they would be stopped at interpreter exit with SIGTERM, which workers deliberately outlive for
    WORKER_GRACE_S (see worker_signals). Uses PyTorch's own (private, long-stable) shutdown method.
    """
    try:
        yield batches
    except BaseException:
        shutdown = getattr(batches, "_shutdown_workers", None)
        if callable(shutdown):
            shutdown()
        raise


def _with_exit_signals(message: str, batches: Any) -> str:
    """Add how dead workers died: PyTorch's "exited unexpectedly" path does not say (a private attribute)."""
    if "exited unexpectedly" not in message:
        return message
    batches = getattr(batches, "inner", batches)  # the DataLoader iterator behind a CudaPrefetcher
    codes = [w.exitcode for w in getattr(batches, "_workers", []) if w.exitcode is not None and w.exitcode < 0]
    names = sorted({signal.Signals(-code).name for code in codes if -code in signal.Signals._value2member_map_})
    readable = {"SIGBUS": "Bus error", "SIGKILL": "Killed", "SIGSEGV": "Segmentation fault"}
    shown = ", ".join(readable.get(name, name) for name in names)
    return message.strip().splitlines()[0].rstrip(".") + f" (killed by signal: {shown})" if shown else message


def _free_gb(path: str) -> str:
    try:
        return f"{shutil.disk_usage(path).free / 1e9:.1f} GB free"
    except OSError:
        return "size unknown"


def explain_loader_failure(message: str, data: DataConfig) -> str | None:
    """The likely cause and the setting to change for a DataLoader error message; None if it is not one."""
    first = message.strip().splitlines()[0] if message.strip() else message
    fewer = "lower data.num_workers, data.prefetch_factor or data.batch_size"
    if "timed out after" in first:
        return (
            f"{first}: data.timeout={data.timeout:g} s passed without a batch, so a worker is stuck or very slow "
            "(hung network storage, a deadlock after fork, a very slow transform). Raise data.timeout, try "
            "data.multiprocessing_context=spawn, or run with data.num_workers=0 to see where it hangs"
        )
    if "Bus error" in first or "shared memory" in first or "No space left on device" in first:
        return (
            f"{first}: shared memory (/dev/shm, {_free_gb('/dev/shm')}) is too small for the batches in flight "
            f"(num_workers x prefetch_factor batches). {fewer}; in Docker, start the container with "
            "--shm-size=8g or --ipc=host"
        )
    if "signal: Killed" in first:
        available = psutil.virtual_memory().available / 1e9
        return (
            f"{first}: most likely the out-of-memory killer (host memory now {available:.1f} GB available). "
            f"{fewer}, or set data.persistent_workers=false; `dmesg` shows OOM kills"
        )
    if "received 0 items of ancdata" in first or "Too many open files" in first:
        return (
            f"{first}: the process ran out of file descriptors passing tensors between processes. Raise the "
            "limit (`ulimit -n 65536`) or lower data.num_workers and data.prefetch_factor"
        )
    if re.search(r"DataLoader worker \(pid", first):
        return (
            f"{first}: a worker crashed, possibly in native decoding code or out of memory. Run with "
            "data.num_workers=0 to get the Python error, or lower data.num_workers and data.prefetch_factor"
        )
    return None
