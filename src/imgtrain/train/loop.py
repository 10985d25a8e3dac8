"""The training loop. `train_one_epoch` is the whole step: data, forward, loss, backward, update, one call to the
instruments and one to the checkpointer, then the termination conditions. `fit` runs the epochs and validation,
and ends the run on a stop; `EpochBatches` is the batch iterator that times the wait for each batch and hands
unreadable files to the fault handler. The loop measures nothing itself: whatever does is an instrument
(`train/instruments.py`), called through `Instruments`; what the ranks agree on once per logging window (stops,
NaN losses, the checkpoint clock) the loop exchanges itself (`close_window`) and hands to the instruments.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from imgtrain.config.data import DataConfig
from imgtrain.config.schema import Mode
from imgtrain.config.val_metrics import VAL_METRICS, batch_sums, field, tag
from imgtrain.data.failures import (
    LoaderFailed,
    first_batches,
    next_batch,
    worker_deaths_found_at_next_batch,
    workers_stopped_on_error,
)
from imgtrain.data.feed import Feed
from imgtrain.data.pipeline import RunData
from imgtrain.data.stages import transfer_seconds
from imgtrain.host import dist
from imgtrain.resilience.agreement import LoggingWindows
from imgtrain.resilience.checkpoint import Checkpointer, Progress
from imgtrain.resilience.faults import Faults, Stop
from imgtrain.train.instruments import Instruments, Mark, no_range
from imgtrain.train.placement import evaluation_module, uncompiled
from imgtrain.train.step import Step

log = logging.getLogger(__name__)


def train_one_epoch(
    model: nn.Module, batches: Iterator[tuple[torch.Tensor, torch.Tensor]], step: Step, parts: Components
) -> Stop | None:
    """One pass over `batches` (images and labels already on the device), or until a stop: the stop, if any.
    No GPU sync here but where a logging window ends (every `metrics.log_every_n_steps` steps): there the ranks
    agree on what stops the run. `mark` labels the step's ranges for an instrument that traces them (the
    profiler of metrics.profile=true); otherwise it does nothing."""
    faults, instruments, checkpointer, progress, windows = parts.faults, parts.instruments, *parts.engine
    mark = instruments.range
    model.train()
    for images, labels in batches:
        images, targets = step.mix(images, labels, progress.step)  # mixup/cutmix (train.*_alpha): soft targets
        logits, loss = step.forward(model, images, targets, mark=mark)  # autocast, the `loss` group's loss
        if faults.allows_update(loss, progress.step + 1):  # False only with nonfinite=skip and a NaN/inf loss
            step.update(loss, mark=mark, step=progress.step + 1)  # backward, optimizer, LR schedule, EMA
        progress.advance(labels.shape[0])
        instruments.on_step_end(progress.step, loss, logits, labels)  # on the device: no sync
        if windows.due(progress.step):
            close_window(parts, progress.step)  # the one sync and the one exchange of the window
        checkpointer.step()  # last.pt every checkpoint.every_n_steps steps or checkpoint.every_min minutes
        # termination conditions, agreed by every rank at the last logging window (one process: a signal at once)
        stop = faults.stop()  # a stop signal, a NaN/inf loss, the bad-data budget, a failed checkpoint write
        if stop:
            return stop
    return None


def close_window(parts: Components, step: int) -> None:
    """A logging window ends after `step`: the instruments' figures (their read-back of the loss: the window's
    one sync) and the faults' and the checkpointer's fields go out in one exchange; every rank then acts on the
    same agreement, and the instruments log it."""
    perf = parts.instruments.window_report(step)
    agreed = parts.windows.agree(step, perf)
    parts.instruments.on_window(step, agreed)


class EpochBatches:
    """One epoch of a loader's batches on the device, at most `limit` of them (a context manager).

    The time `next()` blocks is the data wait; it goes to `on_batch` with the part of it after the batch was
    finished (transfer) and the batch's stage times. The unreadable files each batch replaced go to
    `on_unreadable`, and their number is kept in `unreadable`. DataLoader failures become one line. `mark`
    labels the data wait and the copy to the device in a profiler trace (`Profiler.range`).
    """

    def __init__(
        self,
        loader: Any,
        feed: Feed,
        data: DataConfig,
        limit: float,
        *,
        on_unreadable: Callable[[tuple[tuple[str, str], ...]], None],
        on_batch: Callable[[float, float, tuple], None] | None = None,
        split: str = "train",
        mark: Mark = no_range,
    ) -> None:
        self.loader, self.feed, self.data, self.limit, self.split = loader, feed, data, limit, split
        self.on_unreadable, self.on_batch = on_unreadable, on_batch or (lambda wait, transfer, times: None)
        self.mark = mark
        self.taken, self.unreadable = 0, 0
        self.exhausted = False  # the loader ran out: the epoch ended
        self._stack = contextlib.ExitStack()

    def __enter__(self) -> EpochBatches:
        # the workers start, or resume (persistent), with SIGCHLD left at its default
        started = worker_deaths_found_at_next_batch(lambda: first_batches(self.loader, self.data))
        loader_batches = self._stack.enter_context(started)
        # Entered last, so it leaves first: after an error the workers stop while SIGCHLD is still quiet, not
        # under PyTorch's handler, which would raise a second error (a traceback) from inside their shutdown.
        loader_batches = self._stack.enter_context(workers_stopped_on_error(loader_batches))
        self.batches = self._stack.enter_context(self.feed.batches(loader_batches, self.split))
        return self

    def __exit__(self, *exc: Any) -> bool | None:
        return self._stack.__exit__(*exc)

    @property
    def completed(self) -> bool:
        """Whether the whole epoch was taken (not cut short by train.max_steps)."""
        return self.exhausted or self.taken >= len(self.loader)

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        while self.taken < self.limit:
            started = time.perf_counter()
            with self.mark("data_wait"):
                batch = next_batch(self.batches, self.data)  # blocks while no batch is ready: the data wait
            if batch is None:
                self.exhausted = True
                return
            received = time.perf_counter()
            self.on_batch(received - started, transfer_seconds(batch.times, started, received), batch.times)
            self.taken += 1
            self.unreadable += len(batch.skipped)
            self.on_unreadable(batch.skipped)
            if batch.labels.shape[0]:  # validation drops unreadable images: a batch of them all has none left
                with self.mark("h2d"):  # the copy (unless prefetched), a device crop (data.augment_on), to float
                    on_device = self.feed.to_model(batch)
                yield on_device


@dataclass
class Components:
    """What the loop calls besides the model, the data and the update, built once by `run`."""

    faults: Faults
    instruments: Instruments  # whatever measures the run; none at all trains the same
    checkpointer: Checkpointer
    progress: Progress
    windows: LoggingWindows  # where the ranks agree, once per logging window

    @property
    def engine(self) -> tuple[Checkpointer, Progress, LoggingWindows]:
        return self.checkpointer, self.progress, self.windows


@contextlib.contextmanager
def saved_on_loader_failure(parts: Components) -> Iterator[None]:
    """A DataLoader failure comes between steps, so one process saves the last completed step before the one line
    ends the run. Under DDP the other ranks may already wait in a collective for this one: the last periodic
    checkpoint stands, and torchrun stops them."""
    try:
        yield
    except LoaderFailed as failure:
        checkpointer = parts.checkpointer
        where = checkpointer.save_and_wait() if parts.faults.alone else checkpointer.settled_checkpoint()
        again = "Run the same command again to continue from it."
        notes = parts.instruments.failure_notes()  # the metrics: the memory peaks
        raise LoaderFailed(f"{failure}. {notes + ' ' if notes else ''}{where} {again}") from None


@torch.no_grad()
def evaluate(
    model: nn.Module, data: RunData, step: Step, faults: Faults, last_checkpoint: Callable[[], str]
) -> dict[str, float]:
    """Every entry of VAL_METRICS (config/val_metrics.py) over the validation set, each sample counted once across
    ranks: val_acc, val_acc5, val_loss, ..., and with train.ema_decay the EMA's (val_acc_ema, ...) from the same
    batches, read once."""
    # no collective per batch (the ranks may have different numbers of batches); uncompiled with CUDA graphs
    model = evaluation_module(model, step.cuda_graphs)
    model.eval()
    # Compiled, the model compiles once more for inference; a batch of another size (the last, or one with
    # unreadable images left out) would compile it yet again, for seconds (minutes with max_autotune): eager.
    full, eager = data.loader_args["val"]["batch_size"], uncompiled(model)
    averaged = [] if step.ema is None else [step.ema.synced()]  # never compiled: eager
    # a row per model (the model, its EMA): each entry's sum over the images; and the images counted
    totals = torch.zeros(1 + len(averaged), len(VAL_METRICS), device=data.feed.device, dtype=torch.float64)
    count = torch.zeros(1, device=data.feed.device, dtype=torch.float64)
    batches = EpochBatches(
        data.val, data.feed, data.settings, float("inf"), on_unreadable=faults.bad.report, split="val"
    )
    with batches:
        for images, labels in batches:
            with step.autocast():
                outputs = [(model if labels.shape[0] == full else eager)(images), *(ema(images) for ema in averaged)]
            for row, logits in enumerate(outputs):
                totals[row] += batch_sums(logits, labels)
            count += labels.shape[0]
    local = torch.cat([totals.flatten(), count]).tolist()  # the one read back
    *sums, images, unreadable = dist.all_reduce_sum([*local, batches.unreadable], totals.device)
    if unreadable:
        faults.count_unreadable(int(unreadable), last_checkpoint)
    figures, per_model = {"val_count": int(images)}, len(VAL_METRICS)
    for row in range(totals.shape[0]):
        for metric, total in zip(VAL_METRICS, sums[row * per_model : (row + 1) * per_model], strict=True):
            figures[field(metric, ema=row == 1)] = total / max(images, 1)
    return figures


def fit(model: nn.Module, data: RunData, step: Step, parts: Components, mode: Mode, epochs: int) -> None:
    """Train from `parts.progress` to `parts.checkpointer.total_steps`; in mode=train, validate and save at
    every epoch end."""
    with worker_deaths_found_at_next_batch():  # between epochs too: see `_fit`
        _fit(model, data, step, parts, mode, epochs)


def _fit(model: nn.Module, data: RunData, step: Step, parts: Components, mode: Mode, epochs: int) -> None:
    """`fit`'s epochs, with SIGCHLD at its default throughout: a persistent training worker that dies while the
    epoch's end validates and saves is found as the next epoch starts, in one line, with its checkpoint saved."""
    progress = parts.progress
    for epoch in range(progress.epoch, epochs):
        progress.begin_epoch(epoch)
        data.start_epoch(epoch, progress.samples_in_epoch)
        parts.instruments.on_epoch_start(epoch, len(data.train))
        parts.windows.begin(progress.step)
        limit = parts.checkpointer.total_steps - progress.step
        batches = EpochBatches(
            data.train,
            data.feed,
            data.settings,
            limit,
            on_unreadable=parts.faults.unreadable,
            on_batch=parts.instruments.on_batch,
            mark=parts.instruments.range,
        )
        with saved_on_loader_failure(parts), batches:  # e.g. a worker the OOM killer ended: one line, saved
            stop = train_one_epoch(model, batches, step, parts)
        if stop is None:  # a stopped epoch leaves its partial window unlogged: the resumed run logs it whole
            if parts.windows.open(progress.step):  # the epoch's last, partial window: it may agree on a stop too
                close_window(parts, progress.step)
            parts.instruments.on_epoch_end(progress.step)
            stop = parts.faults.stop()
        if stop:
            raise parts.checkpointer.stopped(stop)  # saved unless a NaN reached the weights; one line, exit code
        if mode == Mode.train:
            _end_epoch(model, data, step, parts, epochs=epochs, completed=batches.completed)
        elif batches.completed:
            progress.end_epoch()


def _end_epoch(model: nn.Module, data: RunData, step: Step, parts: Components, *, epochs: int, completed: bool):
    """Validate (the model, and its EMA), log, and save (always at the end of the run; best.pt when the accuracy
    checkpoint.best_of follows improved). An epoch cut short by train.max_steps keeps its position, so a longer run
    continues from there."""
    progress = parts.progress
    val = evaluate(model, data, step, parts.faults, parts.checkpointer.settled_checkpoint)
    improved = progress.validated(val, ema_best=parts.checkpointer.best_of_ema)
    tags = {tag(metric, ema): val[field(metric, ema)] for ema in _models(step) for metric in VAL_METRICS}
    parts.instruments.on_eval({**tags, "data/skipped_samples": parts.faults.counts.skipped_samples}, progress.step)
    log.info("epoch %d/%d: %s", progress.epoch + 1, epochs, _figures(val, step))
    if completed:
        progress.end_epoch()
    parts.checkpointer.end_epoch(improved, last=progress.step >= parts.checkpointer.total_steps)


def _models(step: Step) -> tuple[bool, ...]:
    """What validation reported on: the model (False), and its EMA (True) with train.ema_decay."""
    return (False,) if step.ema is None else (False, True)


def _figures(val: dict[str, float], step: Step) -> str:
    """`val_acc 0.8750  val_acc5 0.9912  val_loss 0.4321  |  val_acc_ema ...`: the model's figures, then its EMA's."""
    return "  |  ".join(
        "  ".join(f"{field(metric, ema)} {val[field(metric, ema)]:.4f}" for metric in VAL_METRICS)
        for ema in _models(step)
    )
