"""The run's checkpointer: when to save, saving without stalling the loop, and resuming.

When: every `checkpoint.every_min` minutes of wall time (rank 0's clock, agreed at a logging window so every
rank saves at the same step), every `checkpoint.every_n_steps` steps if set, at an epoch end when the clock
says so or validation improved (best.pt), at the end of the run, and at once on a stop signal.
How: the training thread copies the state to host memory (`HostSnapshot`) and goes on; `AsyncWriter` writes,
verifies and renames it in the background. Only rank 0 writes; the other ranks never wait for a periodic save.
"""

from __future__ import annotations

import contextlib
import logging
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Protocol

from omegaconf import OmegaConf
from torch import nn

from imgtrain.common.disk import disk_full_line, is_disk_full
from imgtrain.common.errors import ConfigError, RunError, first_line
from imgtrain.config.checkpoint import BestOf
from imgtrain.config.schema import Config, Mode
from imgtrain.host import dist
from imgtrain.resilience.agreement import Agreement
from imgtrain.resilience.checkpoint.changes import changed_settings
from imgtrain.resilience.checkpoint.files import DIRNAME, FORMAT, FORMAT_VERSION, CheckpointStore, locate
from imgtrain.resilience.checkpoint.files import load as load_checkpoint
from imgtrain.resilience.checkpoint.shape import FieldError, check_reach, check_shape, epoch_samples_bound
from imgtrain.resilience.checkpoint.state import (
    HostSnapshot,
    Progress,
    capture_rng,
    progress_dict,
    progress_from,
    restore_rng,
)
from imgtrain.resilience.checkpoint.writer import AsyncWriter
from imgtrain.resilience.faults import Faults, Preempted, Stop, StopReason

log = logging.getLogger(__name__)


class StepState(Protocol):
    """What the checkpoints need of the training step (train/step.py's `Step`): its state, and the LR schedule
    positioned by the steps already taken."""

    steps_per_epoch: int

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> str | None: ...

    def resume_schedule(self, position: int) -> None: ...


class Checkpointer:
    """A run's checkpoints: resume, timed, periodic and epoch-end saves, best.pt, and the save a stop makes.

    Every rank calls the same methods at the same steps, so all agree on where the last checkpoint is. It reads
    the loop's `Progress` (from `resume`) and the faults' counts to save them; it writes neither.
    """

    def __init__(self, settings: Config, out_dir: Path, info: dist.DistInfo, faults: Faults) -> None:
        self.settings, self.info, self.faults = settings, info, faults
        self.writes = settings.mode == Mode.train and settings.checkpoint.save  # ceilings: speed only
        self.store = CheckpointStore(out_dir / DIRNAME, enabled=self.writes and info.is_main)
        self.every_steps = settings.checkpoint.every_n_steps
        self.every_s = None if settings.checkpoint.every_min is None else settings.checkpoint.every_min * 60.0
        self.last_save = time.monotonic()  # the clock starts with the run
        self.due = False  # agreed at a window: rank 0's clock has run out
        self.written_step: int | None = None  # the step of the newest checkpoint known to be on disk
        self.snapshot, self.writer = HostSnapshot(), AsyncWriter()
        self.model: nn.Module | None = None
        self.step_state: StepState | None = None
        self.order: Any = None  # dataset=shards: the training order's state (state_dict / load_state_dict)
        self.progress = Progress()  # the loop's, from `resume` on
        self.total_steps = 0

    @property
    def best_of_ema(self) -> bool:
        """Whether best.pt follows the EMA's accuracy (checkpoint.best_of=ema, with train.ema_decay) over the model's.
        best.pt is then the checkpoint of that epoch, the EMA's weights under its `ema` key."""
        return self.settings.checkpoint.best_of == BestOf.ema and self.settings.train.ema_decay is not None

    def attach(self, model: nn.Module, step: StepState, total_steps: int, order: Any = None) -> None:
        """What the checkpoints hold: the underlying model (not its DDP or compiled wrapper), the Step and, for a
        streamed dataset, the state of its order (the topology its epoch started with)."""
        self.model, self.step_state, self.total_steps, self.order = model, step, total_steps, order

    @contextlib.contextmanager
    def writing(self) -> Iterator[Checkpointer]:
        """Training with background writes: on the way out, whatever the reason, the write in flight finishes."""
        try:
            yield self
        finally:
            self.writer.close()
        if self.writer.failure is not None:  # the last save failed after the run had otherwise finished
            raise self._write_failure()

    # ------------------------------------------------------------------ the logging window's exchange
    def report(self) -> dict[str, bool]:
        """Rank 0's clock and write outcome, its fields of the window's `WindowReport` (other ranks: False)."""
        clock = self.every_s is not None and self.store.enabled and time.monotonic() - self.last_save >= self.every_s
        return {"checkpoint_due": clock, "write_failed": self.store.enabled and self.writer.failed}

    def agree(self, agreed: Agreement) -> None:
        self.due = self.due or agreed.checkpoint_due

    # ------------------------------------------------------------------ the loop's calls
    def step(self) -> None:
        """After every step: save when the clock or the step interval says, unless a stop (which saves) is agreed
        or, with faults.nonfinite=stop, a NaN loss has reached the weights."""
        step = self.progress.step
        interval = self.every_steps and step % self.every_steps == 0
        if not ((interval or self.due) and step < self.total_steps) or self.faults.stop():
            return
        self.faults.read_nan_step()
        if not self.faults.stop():
            self.save(nan_read=True)

    def stopped(self, stop: Stop) -> BaseException:
        """Act on an agreed stop at a step boundary: save what may be saved (never weights a NaN loss has reached)
        and return the exception that ends the run with one line (Preempted for a signal: exit 128 + its number)."""
        self.faults.read_nan_step()  # nonfinite=stop: a NaN since the last window outranks the other reasons
        stop = self.faults.stop() or stop
        if stop.reason == StopReason.NONFINITE:
            return self.faults.nonfinite_error(self.progress.epoch, self.settled_checkpoint())
        if stop.reason == StopReason.WRITE_FAILED:
            return self._write_failure()
        where = self.save_and_wait(nan_read=True)
        if stop.reason == StopReason.BAD_DATA:
            return self.faults.bad.error(where)
        name, step = signal.Signals(stop.signum).name, self.progress.step
        log.warning("%s: stopped at step %d. %s", name, step, where)
        self.faults.signals.hand_over(stop.signum)  # submitit's handler (if any) requeues the job and exits here
        return Preempted(
            stop.signum,
            f"{name} at step {step}: {where} Run the same command again in the same run directory "
            "(hydra.run.dir=...) to continue, or pass checkpoint.resume=<checkpoint>",
        )

    def end_epoch(self, improved: bool, last: bool) -> None:
        """At an epoch end: save when validation improved (best.pt too), when the clock says (every epoch with
        checkpoint.every_min=null), and at the end of the run, where every rank waits for the write."""
        if last:
            self.save_and_wait(best=improved)
        elif improved or self.due or self.every_s is None:
            self.save(best=improved)

    def save(self, best: bool = False, wait: bool = False, nan_read: bool = False) -> str:
        """Start writing last.pt (rank 0), never with weights a NaN loss has reached; a sentence saying where."""
        if not nan_read:  # `nan_read`: the caller has just agreed on the NaN step (one sync and exchange, not two)
            self.faults.before_save(self.settled_checkpoint, self.progress.epoch)
        self.faults.merge_unreadable()  # every rank's distinct unreadable files, into the saved progress
        self.due, self.last_save = False, time.monotonic()
        if not self.writes:
            return "Checkpoints are off (checkpoint.save=false or mode is not train)."
        if self.store.enabled:
            self._start_write(best, wait)
        return f"The last checkpoint is {self.store.last} (step {self.progress.step})."

    def save_and_wait(self, best: bool = False, nan_read: bool = False) -> str:
        """Save and wait until it is on disk; every rank learns the outcome from rank 0 (so torchrun does not
        kill rank 0 mid-write, and a failed write stops every rank with the same line)."""
        where = self.save(best=best, wait=True, nan_read=nan_read)
        failure = str(self._write_failure()) if self.store.enabled and self.writer.failure is not None else None
        failure = dist.broadcast_plain(failure, self.info)
        if failure:
            raise RunError(failure)
        return where

    def _start_write(self, best: bool, wait: bool) -> None:
        step = self.progress.step
        if self.writer.busy and not (wait or best):
            log.info(
                "checkpoint of step %d skipped: the one of step %d is still being written",
                *(step, self.writer.pending_step),
            )
            return
        if self.writer.busy:
            previous = self.writer.pending_step
            waited = self.writer.wait()
            log.info("waited %.2f s for the checkpoint of step %d before saving step %d", waited, previous, step)
        if self.writer.failed:
            return  # the run stops with that failure (now if waiting, else at the next window), keeping last.pt
        started = time.perf_counter()
        payload = self.snapshot.take(self._payload())  # queued copies to host memory; training goes on
        copied_s = time.perf_counter() - started  # what the training thread spends on this save

        def write() -> None:
            started = time.perf_counter()
            self.snapshot.ready()
            self.store.save(payload, best=best)
            self.written_step = step
            log.info(
                "checkpoint of step %d: %.3f s on the training thread, then written in %.2f s in the background",
                *(step, copied_s, time.perf_counter() - started),
            )

        self.writer.submit(write, step)
        if wait:
            self.writer.wait()

    def _payload(self) -> dict[str, Any]:
        return {
            "format": FORMAT,
            "version": FORMAT_VERSION,
            "model": self.model.state_dict(),
            **self.step_state.state_dict(),
            "progress": progress_dict(self.progress, self.faults.counts),
            "rng": capture_rng(),
            "global_batch": self.settings.data.batch_size * self.info.world_size,
            "config": OmegaConf.to_yaml(self.settings),
            **({"data_order": self.order.state_dict()} if self.order is not None else {}),
        }

    def _write_failure(self) -> RunError:
        """One line for a failed write (ENOSPC, EIO, a file that does not verify): what is kept, what to do."""
        error = self.writer.failure
        if error is None:  # another rank: rank 0's log has the reason
            return RunError(f"rank 0 could not write a checkpoint (its log says why). {self.last_checkpoint()}")
        if is_disk_full(error):  # torch.save's own message for it is "unexpected pos N vs M": say which disk
            reason = disk_full_line(self.store.last, error)
        else:
            reason = getattr(error, "strerror", None) or str(error).strip().splitlines()[0] or type(error).__name__
        return RunError(
            f"could not write the checkpoint of step {self.writer.failed_step} to {self.store.last} ({reason}); "
            f"the run stopped. {self.last_checkpoint()} Free space or fix the disk, then run the same command "
            "again to resume from it"
        )

    def settled_checkpoint(self) -> str:
        """`last_checkpoint` once the write in flight, if any, has finished: what a stop message may promise. Built
        only when a message needs it (it stats last.pt)."""
        if self.store.enabled and self.writer.busy:
            self.writer.wait()
        return self.last_checkpoint()

    def last_checkpoint(self) -> str:
        last = self.store.last
        if not last.exists():
            return "No checkpoint had been written yet."
        known = f" (step {self.written_step})" if self.written_step is not None else ""
        return f"The last good checkpoint is {last}{known}."

    # ------------------------------------------------------------------ resume
    def resume(self, replicas: int = 1) -> Progress:
        """Load what `checkpoint.resume` points at (rank 0 chooses the file, every rank reads it), else start fresh:
        the loop's Progress (`replicas`: the ranks the training order is sharded over)."""
        self.progress = Progress(replicas=replicas)
        if self.settings.mode != Mode.train:
            return self.progress
        found, problem = None, None
        if self.info.is_main:
            try:
                found = locate(self.settings.checkpoint.resume, self.store)
            except (ConfigError, RunError) as error:
                problem = error
        chosen = dist.broadcast_plain(
            ("error", str(problem)) if problem else str(found[0]) if found else None, self.info
        )
        if isinstance(chosen, list):  # every rank stops with rank 0's message, none waits for the others
            raise problem if problem else RunError(chosen[1])
        if chosen is None:
            return self.progress
        payload = found[1] if self.info.is_main else load_checkpoint(Path(chosen))
        self._restore(payload, chosen, replicas)
        if Path(chosen) == self.store.last:
            self.written_step = self.progress.step
        return self.progress

    def _restore(self, payload: dict[str, Any], chosen: str, replicas: int) -> None:
        self._check_fields(payload, chosen)
        try:
            self.model.load_state_dict(payload["model"])
            fresh = self.step_state.load_state_dict(payload)
        except (RuntimeError, ValueError, KeyError, TypeError) as error:  # another model or number of classes
            raise RunError(
                f"the checkpoint {chosen} does not fit this run's model or optimizer ({first_line(error)}): resume "
                "with the settings it was trained with, or pass checkpoint.resume=none (or a new hydra.run.dir) to "
                "start over"
            ) from None
        try:
            restore_rng(payload["rng"])
            if self.order is not None:
                self.order.load_state_dict(payload.get("data_order"))
            self.progress, counts = progress_from(payload, replicas)
        except (KeyError, TypeError, ValueError, AttributeError, IndexError, RuntimeError, OverflowError) as error:
            raise self._not_ours(chosen, f"no {error}" if isinstance(error, KeyError) else first_line(error)) from None
        self.faults.restore(counts)
        log.info(
            "resuming from %s: step %d, epoch %d, %d samples into the epoch",
            *(chosen, self.progress.step, self.progress.epoch + 1, self.progress.samples_in_epoch),
        )
        self._follow_this_runs_schedule(payload, fresh)

    def _check_fields(self, payload: dict[str, Any], chosen: str) -> None:
        """Every field's kind (a file that passed load()'s checks but was edited, or written elsewhere), then the
        stored progress against this run: one line naming the file and the field, before any of it is used."""
        try:
            check_shape(payload)
        except FieldError as error:
            raise self._not_ours(chosen, f"its field {error}") from None
        global_batch = self.settings.data.batch_size * self.info.world_size
        bound = epoch_samples_bound(self.step_state.steps_per_epoch, global_batch, payload["global_batch"])
        try:
            check_reach(payload, self.settings.train.epochs, bound)
        except FieldError as error:
            raise RunError(
                f"the checkpoint {chosen} holds progress this run cannot reach (its field {error}): resume it with "
                "the data and train.epochs it was trained with, or pass checkpoint.resume=none (or a new "
                "hydra.run.dir) to start over"
            ) from None

    @staticmethod
    def _not_ours(chosen: str, what: str) -> RunError:
        return RunError(
            f"the checkpoint {chosen} is not one imgtrain can resume ({what}): pass checkpoint.resume=none (or a "
            "new hydra.run.dir) to start over, or checkpoint.resume=<another checkpoint>"
        )

    def _follow_this_runs_schedule(self, payload: dict[str, Any], fresh: str | None) -> None:
        """Position this run's LR schedule at the point of training the checkpoint reached, counted in samples as
        the data is (epochs done, samples into this one), so a run resumed with another batch size, more epochs or
        another schedule continues where training was, by its own settings. The loop still counts optimizer steps
        from the checkpoint's (TensorBoard's x axis), so the end of the run moves by the difference. Says in one
        line what changed."""
        global_batch = self.settings.data.batch_size * self.info.world_size
        position = self.progress.epoch * self.step_state.steps_per_epoch
        position += self.progress.samples_in_epoch // global_batch
        # Replayed at most to the end of this run's schedule (check_reach bounds `position` too): past it this run
        # takes no step, so the cost is that of the run's own schedule, never that of a number read from a file
        self.step_state.resume_schedule(min(position, self.total_steps))
        scheduled = self.total_steps
        self.total_steps += self.progress.step - position
        changes = changed_settings(payload.get("config"), self.settings, payload["global_batch"], global_batch)
        if not changes and fresh is None:
            return
        place = f"epoch {self.progress.epoch + 1}, sample {self.progress.samples_in_epoch}"
        moments = fresh or "the optimizer's moments come from the checkpoint"
        log.warning(
            "resuming with settings other than the checkpoint's (%s): %s; the hyperparameters and the LR schedule "
            "follow this run's settings from where training was (%s: step %d of this run's %d-step schedule)",
            *(", ".join(changes) or "the same settings", moments, place, position, scheduled),
        )
