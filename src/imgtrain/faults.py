"""What ends a run early, acted on where the loop already syncs: stop signals, non-finite losses, bad data.

Under DDP every rank must take the same branch at the same step. Nothing here adds a collective per step:
each rank's stop signal, unreadable-image count and first NaN step travel with the metrics' one exchange per
logging window (`local` out, `agree` in), and every rank acts on the agreed values at that step (`act`).
The exception is trainer.nonfinite=skip, which must know before each update, by design.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from collections.abc import Callable
from typing import Any

import torch

from imgtrain import dist
from imgtrain.config import NonFinite
from imgtrain.data.loader import STOP_SIGNALS, SUBMITIT_SIGNAL
from imgtrain.errors import RunError

log = logging.getLogger(__name__)

# A SIGINT this long after the first is a second Ctrl-C. Sooner it is the same one again: torchrun's agent
# forwards the terminal's SIGINT to every rank, which the terminal has already signalled, within milliseconds.
SECOND_CTRL_C_AFTER_S = 1.0


class Preempted(BaseException):  # noqa: N818 - like KeyboardInterrupt: it ends a sweep too, not just one job
    """A stop signal arrived; the checkpoint is saved and the process exits with 128 + the signal number."""

    def __init__(self, signum: int, message: str) -> None:
        super().__init__(message)
        self.signum = signum

    @property
    def exit_code(self) -> int:
        return 128 + self.signum  # the shell's convention for "ended by this signal"; SLURM and torchrun see a failure


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

    def __exit__(self, *exc: object) -> None:
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


class BadSampleBudget:
    """Counts unreadable images (each read counts) and stops the run once `data.max_bad_samples` is passed."""

    def __init__(self, limit: int | None, count: int = 0) -> None:
        self.limit, self.count = limit, count
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
        return self.limit is not None and self.count > self.limit

    def error(self, checkpoint: str) -> RunError:
        shown = "; ".join(self.examples) or "see the warnings above"
        return RunError(
            f"data.max_bad_samples={self.limit} exceeded: {self.count} image reads failed (e.g. {shown}). "
            f"Fix or remove those files, or raise data.max_bad_samples (null = no limit). {checkpoint}"
        )


class Faults:
    """One run's fault handling; `progress` (checkpoint.Progress) gets the counts that are saved with it."""

    def __init__(
        self, policy: NonFinite, max_bad_samples: int | None, progress: Any, device: torch.device, alone: bool = True
    ) -> None:
        self.policy, self.progress = policy, progress
        self.alone = alone  # one process: a stop signal needs no agreement and is acted on after the current step
        self.signals = StopSignals()
        self.bad = BadSampleBudget(max_bad_samples, progress.skipped_samples)
        self.unreported = 0  # this rank's unreadable reads since the last window
        # trainer.nonfinite=stop: the first step with a NaN/inf loss (-1: none), on the device until a sync
        self.nan_step = torch.full((), -1, dtype=torch.long, device=device) if policy == NonFinite.stop else None
        self.stop_signal = 0  # agreed at a window: a stop signal any rank received
        self.first_nan = 0  # agreed at a window: the first NaN step on any rank

    def __enter__(self) -> Faults:
        self.signals.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self.signals.__exit__()

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
        self.progress.nonfinite_steps += 1
        log.warning("non-finite loss at step %d: step skipped (%d so far)", step, self.progress.nonfinite_steps)
        return False

    def unreadable(self, skipped: tuple[tuple[str, str], ...]) -> None:
        """Unreadable files replaced in a batch of this rank: logged by path, counted at the next window."""
        self.bad.report(skipped)
        self.unreported += len(skipped)

    # ------------------------------------------------------------------ logging windows (after the loss is read)
    def local(self) -> list[float]:
        """This rank's numbers for the window's exchange: stop signal, unreadable reads, first NaN step."""
        nan = float(self.nan_step.item()) if self.nan_step is not None else -1.0  # the GPU has just synced
        values = [float(self.signals.received), float(self.unreported), nan]
        self.unreported = 0
        return values

    def agree(self, rows: list[list[float]]) -> None:
        """Every rank's `local` values: from now on every rank acts on the same ones."""
        self.stop_signal = max(self.stop_signal, int(max(row[0] for row in rows)))
        self.bad.count += int(sum(row[1] for row in rows))
        self.progress.skipped_samples = self.bad.count
        nans = [int(row[2]) for row in rows if row[2] >= 0]
        self.first_nan = self.first_nan or (min(nans) if nans else 0)

    def act(self, save_and_wait: Callable[[], str], last_checkpoint: Callable[[], str]) -> None:
        """At a step boundary: stop on an agreed NaN, exceeded budget or stop signal (saving first, but never
        weights a NaN has reached)."""
        if self.alone and self.signals.received:
            self.stop_signal = self.signals.received
        if self.first_nan:
            self._stop_nonfinite(last_checkpoint)
        if self.bad.exceeded:
            raise self.bad.error(save_and_wait())
        if self.stop_signal:
            where = save_and_wait()
            name = signal.Signals(self.stop_signal).name
            log.warning("%s: stopped at step %d. %s", name, self.progress.step, where)
            self.signals.hand_over(self.stop_signal)  # submitit's handler (if any) requeues the job and exits here
            raise Preempted(
                self.stop_signal,
                f"{name} at step {self.progress.step}: {where} Run the same command again in the same run directory "
                "(hydra.run.dir=...) to continue, or pass trainer.resume=<checkpoint>",
            )

    def before_save(self, last_checkpoint: Callable[[], str]) -> None:
        """nonfinite=stop: read the first NaN step of every rank (one sync, one exchange) before writing weights."""
        if self.nan_step is not None:
            self.agree([[0.0, 0.0, row[0]] for row in dist.all_gather_host([float(self.nan_step.item())])])
        if self.first_nan:
            self._stop_nonfinite(last_checkpoint)

    def _stop_nonfinite(self, last_checkpoint: Callable[[], str]) -> None:
        self.progress.nonfinite_steps += 1
        raise RunError(
            f"the training loss is NaN or infinite at step {self.first_nan} (epoch {self.progress.epoch + 1}) and "
            f"trainer.nonfinite=stop. {last_checkpoint()} Lower optim.lr, try trainer.precision=fp32, or set "
            "trainer.nonfinite=skip"
        )

    def merge_unreadable(self) -> None:
        """Every rank's distinct unreadable files into `progress.unreadable_files` (before a save and at the end
        of the run). Under DDP one object exchange, and only once an unreadable read has been agreed on."""
        if self.alone:
            rows = [self.bad.new_files]
        elif self.bad.count:
            rows = dist.all_gather_objects(self.bad.new_files)
        else:
            return
        for row in rows:
            for path, reason in row.items():
                self.progress.unreadable_files.setdefault(path, reason)
        self.bad.new_files = {}

    def count_unreadable(self, count: int, last_checkpoint: Callable[[], str]) -> None:
        """Unreadable images already summed over ranks (validation): counted, and stop once over budget."""
        self.bad.count += count
        self.progress.skipped_samples = self.bad.count
        if self.bad.exceeded:
            raise self.bad.error(last_checkpoint())
