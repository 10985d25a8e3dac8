"""What ends a run early: stop signals, non-finite losses, bad data, a failed checkpoint write.

Under DDP every rank must take the same branch at the same step. Nothing here adds a collective per step:
each rank's stop signal, unreadable-image count and first NaN step travel in its `agreement.WindowReport`
with the metrics' one exchange per logging window, and every rank reads the same `Stop` from `stop()`
after each step; the loop returns it and `Checkpointer.stopped` acts on it. The exception is
faults.nonfinite=skip, which must know before each update, by design.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

import torch

from imgtrain.common.errors import RunEnded, RunError
from imgtrain.config.faults import NonFinite
from imgtrain.host import dist
from imgtrain.host.signals import STOP_SIGNALS, SUBMITIT_SIGNAL
from imgtrain.resilience.agreement import Agreement, WindowReport, exchange

log = logging.getLogger(__name__)

# A SIGINT this long after the first is a second Ctrl-C. Sooner it is the same one again: torchrun's agent
# forwards the terminal's SIGINT to every rank, which the terminal has already signalled, within milliseconds.
SECOND_CTRL_C_AFTER_S = 1.0


class Preempted(RunEnded):
    """A stop signal arrived and the checkpoint is saved: exit status 128 + the signal's number. It ends a sweep
    too, not just its job (`run`)."""

    def __init__(self, signum: int, message: str) -> None:
        super().__init__(128 + signum, f"stopped: {message}")
        self.signum = signum
        self.message = message

    def __str__(self) -> str:
        return self.message


class StopSignals:
    """Catch stop signals during training: the handler only records them; the run acts at a logging window."""

    def __init__(self) -> None:
        self.received = 0  # the first signal's number; 0 = none
        self._first_at = 0.0  # when it arrived (time.monotonic)
        self._previous: dict[int, Any] = {}
        # What a second Ctrl-C's line names: the checkpointer's `last_checkpoint` once there is one (it only stats).
        self.last_checkpoint: Callable[[], str] = lambda: "No checkpoint had been written yet."

    def __enter__(self) -> StopSignals:
        if threading.current_thread() is not threading.main_thread():
            return self  # Python delivers signals to the main thread only
        wanted = list(STOP_SIGNALS)
        if callable(signal.getsignal(SUBMITIT_SIGNAL)):  # submitit's checkpoint-and-requeue handler is installed
            wanted.append(SUBMITIT_SIGNAL)
        for signum in wanted:
            self._previous[signum] = signal.signal(signum, self._record)
        return self

    def __exit__(self, exc_type: type[BaseException] | None = None, *exc: object) -> None:
        if exc_type is not None and self._previous:
            # The run is ending with its own line (an error, a stop, a lost peer) and still cleans up: workers,
            # the lock, the process group. A stop signal then (torchrun signals every rank once one has failed)
            # must not kill it silently before that line is printed: it stays recorded, and the handlers that
            # were there come back when run() returns (`restore_after_ending`).
            _ENDING.append(self)
            return
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous.clear()

    def _record(self, signum: int, frame: Any) -> None:
        # os.write, not logging: a signal handler must not take the logging locks the main thread may hold.
        if self.received and signum == signal.SIGINT and time.monotonic() - self._first_at > SECOND_CTRL_C_AFTER_S:
            # a second Ctrl-C: the user wants out now, unsaved
            os.write(2, f"[imgtrain] second Ctrl-C: exiting now, without saving. {self.last_checkpoint()}\n".encode())
            os._exit(128 + signum)
        if not self.received:
            self.received, self._first_at = signum, time.monotonic()
            name = signal.Signals(signum).name
            again = " (Ctrl-C again to exit at once, without saving)" if signum == signal.SIGINT else ""
            os.write(2, f"[imgtrain] {name} received: saving a checkpoint before stopping{again}\n".encode())

    def hand_over(self, signum: int) -> None:
        """After the checkpoint: run the handler that was there before (submitit requeues the job and exits)."""
        previous = self._previous.get(signum)
        self.__exit__()
        if callable(previous) and previous is not signal.default_int_handler:  # that one raises KeyboardInterrupt
            previous(signum, None)


_ENDING: list[StopSignals] = []  # handlers kept while a run that left training with an exception ends


def restore_after_ending() -> None:
    """Put back the signal handlers a run kept while it ended with an exception (`StopSignals.__exit__`); run()
    calls it as it returns, so the process (or the next job of a sweep) has its own handlers again."""
    while _ENDING:
        _ENDING.pop().__exit__()


@dataclass
class FaultCounts:
    """What went wrong so far, saved in every checkpoint beside the position (Faults owns and writes it)."""

    skipped_samples: int = 0  # unreadable image reads, summed over ranks (a file read twice counts twice)
    unreadable_files: dict[str, str] = field(default_factory=dict)  # distinct unreadable files: path -> reason
    nonfinite_steps: int = 0  # steps skipped because the loss was NaN or inf (faults.nonfinite=skip)


class StopReason(Enum):
    NONFINITE = "a NaN or infinite loss with faults.nonfinite=stop"
    WRITE_FAILED = "a checkpoint write that failed"
    BAD_DATA = "more unreadable images than data.max_bad_samples"
    SIGNAL = "a stop signal"


@dataclass(frozen=True)
class Stop:
    """The decision to end the run, the same on every rank: the loop returns it, `Checkpointer.stopped` acts."""

    reason: StopReason
    signum: int = 0  # SIGNAL: which one


class BadSampleBudget:
    """Counts unreadable images (each read counts) and stops the run once `data.max_bad_samples` is passed."""

    def __init__(self, limit: int | None, counts: FaultCounts) -> None:
        self.limit, self.counts = limit, counts
        self.examples: list[str] = []
        self.new_files: dict[str, str] = {}  # this rank's unreadable files not yet merged: path -> reason

    def report(self, skipped: tuple[tuple[str, str], ...]) -> None:
        """Log this rank's unreadable images, with their paths."""
        for path, reason in skipped:
            log.warning("skipped an unreadable image: %s: %s", path, reason)
            self.new_files.setdefault(path, reason)
            if len(self.examples) < 3:
                self.examples.append(f"{path}: {reason}")

    @property
    def exceeded(self) -> bool:
        return self.limit is not None and self.counts.skipped_samples > self.limit

    def error(self, checkpoint: str) -> RunError:
        shown = "; ".join(self.examples) or "see the warnings above"
        return RunError(
            f"data.max_bad_samples={self.limit} exceeded: {self.counts.skipped_samples} image reads failed (e.g. "
            f"{shown}). Fix or remove those files, or raise data.max_bad_samples (null = no limit). {checkpoint}"
        )


class Faults:
    """One run's fault handling and its `counts` (saved with every checkpoint)."""

    def __init__(self, policy: NonFinite, max_bad_samples: int | None, device: torch.device, alone: bool = True):
        self.policy = policy
        self.alone = alone  # one process: a stop signal needs no agreement and is acted on after the current step
        self.signals = StopSignals()
        self.counts = FaultCounts()
        self.bad = BadSampleBudget(max_bad_samples, self.counts)
        self.unreported = 0  # this rank's unreadable reads since the last window
        # faults.nonfinite=stop: the first step with a NaN/inf loss (-1: none), on the device until a sync
        self.nan_step = torch.full((), -1, dtype=torch.long, device=device) if policy == NonFinite.stop else None
        self.stop_signal = 0  # agreed at a window: a stop signal any rank received
        self.first_nan = 0  # agreed at a window: the first NaN step on any rank
        self.write_failed = False  # agreed at a window: rank 0's last checkpoint write failed

    def __enter__(self) -> Faults:
        self.signals.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self.signals.__exit__(*exc)

    def restore(self, counts: FaultCounts) -> None:
        """The counts a resumed checkpoint saved."""
        for name in FaultCounts.__dataclass_fields__:  # into the same object: the budget reads it too
            setattr(self.counts, name, getattr(counts, name))

    # ------------------------------------------------------------------ every step
    def allows_update(self, loss: torch.Tensor, step: int) -> bool:
        """Whether step `step` may update the weights: False only with nonfinite=skip and a NaN/inf loss on
        some rank (one read of the loss and one CPU exchange per step). With stop, the first bad step is
        remembered on the device, without a sync, and read at the next window or save."""
        if self.nan_step is not None:
            finite = torch.isfinite(loss.detach()) | (self.nan_step >= 0)
            self.nan_step = torch.where(finite, self.nan_step, step)
            return True
        nonfinite = float(not bool(torch.isfinite(loss.detach())))
        if not any(row[0] for row in dist.all_gather_host([nonfinite])):
            return True
        self.counts.nonfinite_steps += 1
        log.warning("non-finite loss at step %d: step skipped (%d so far)", step, self.counts.nonfinite_steps)
        return False

    def left_out(self, skipped: tuple[tuple[str, str], ...]) -> None:
        """Unreadable files a device-resident training set left out before training: every rank read the same
        ones, so they count once; a resumed run then restores the counts its checkpoint saved."""
        self.counts.skipped_samples += len(skipped)
        for path, reason in skipped:
            self.counts.unreadable_files.setdefault(path, reason)

    def unreadable(self, skipped: tuple[tuple[str, str], ...]) -> None:
        """Unreadable files replaced in a batch of this rank: logged by path, counted at the next window."""
        self.bad.report(skipped)
        self.unreported += len(skipped)

    def stop(self) -> Stop | None:
        """The stop every rank agreed on at the last window (a single process: a signal at once), if any."""
        if self.alone and self.signals.received:
            self.stop_signal = self.signals.received
        if self.first_nan:
            return Stop(StopReason.NONFINITE)
        if self.write_failed:
            return Stop(StopReason.WRITE_FAILED)
        if self.bad.exceeded:
            return Stop(StopReason.BAD_DATA)
        if self.stop_signal:
            return Stop(StopReason.SIGNAL, self.stop_signal)
        return None

    # ------------------------------------------------------------------ logging windows (after the loss is read)
    def report(self) -> dict[str, int]:
        """This rank's fields of the window's `WindowReport`: stop signal, unreadable reads, first NaN step."""
        values = {"stop_signal": self.signals.received, "unreadable": self.unreported, "first_nan_step": self._nan()}
        self.unreported = 0
        return values

    def agree(self, agreed: Agreement) -> None:
        """From now on every rank acts on the same values."""
        self.stop_signal = max(self.stop_signal, agreed.stop_signal)
        self.counts.skipped_samples += agreed.unreadable
        self.first_nan = self.first_nan or agreed.first_nan_step
        self.write_failed = self.write_failed or agreed.write_failed

    def read_nan_step(self) -> None:
        """nonfinite=stop: agree on every rank's first NaN step now (one sync, one exchange), before a save."""
        if self.nan_step is not None:
            self.agree(exchange(WindowReport(first_nan_step=self._nan())))

    def _nan(self) -> int:
        return int(self.nan_step.item()) if self.nan_step is not None else -1  # the GPU has just synced

    def before_save(self, last_checkpoint: Callable[[], str], epoch: int) -> None:
        """Never save weights a NaN loss has reached: read the NaN step, and stop if there is one."""
        self.read_nan_step()
        if self.first_nan:
            raise self.nonfinite_error(epoch, last_checkpoint())

    def nonfinite_error(self, epoch: int, checkpoint: str) -> RunError:
        self.counts.nonfinite_steps += 1
        return RunError(
            f"the training loss is NaN or infinite at step {self.first_nan} (epoch {epoch + 1}) and "
            f"faults.nonfinite=stop. {checkpoint} Lower optim.lr, try system.precision=fp32, or set "
            "faults.nonfinite=skip"
        )

    def merge_unreadable(self) -> None:
        """Every rank's distinct unreadable files into `counts.unreadable_files` (before a save and at the end
        of the run). Under DDP one object exchange, and only once an unreadable read has been agreed on."""
        if self.alone:
            rows = [self.bad.new_files]
        elif self.counts.skipped_samples:
            rows = dist.all_gather_plain(self.bad.new_files)
        else:
            return
        for row in rows:
            for path, reason in row.items():
                self.counts.unreadable_files.setdefault(path, reason)
        self.bad.new_files = {}

    def count_unreadable(self, count: int, last_checkpoint: Callable[[], str]) -> None:
        """Unreadable images already summed over ranks (validation): counted, and stop once over budget."""
        self.counts.skipped_samples += count
        if self.bad.exceeded:
            raise self.bad.error(last_checkpoint())
