"""`run(cfg)`: set up, train, validate, report. The training loop is `train_epoch`, in one place."""

from __future__ import annotations

import gc
import json
import logging
import math
import os
import random
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from hydra.core.hydra_config import HydraConfig
from hydra.errors import HydraException
from hydra.types import RunMode
from omegaconf import DictConfig
from torch import nn

from imgtrain import checkpoint, dist, guards, report
from imgtrain.checkpoint import CheckpointStore, Progress
from imgtrain.cli import one_line
from imgtrain.config import Config, RunError, validate
from imgtrain.loader import EpochSampler
from imgtrain.metrics import MetricsLogger
from imgtrain.monitor import ResourceMonitor
from imgtrain.perf import StepMeter
from imgtrain.pipeline import build_data
from imgtrain.step import Step, build_model, make_step, resolve_precision

log = logging.getLogger(__name__)


def run(cfg: DictConfig) -> float:
    """Train as `cfg` says and return the metric named by `optimized_metric` (what a sweep optimises).

    A job that fails leaves `failed.json` (with the reason) in its run directory, so nothing there looks like a
    finished run. In a multirun it then returns NaN, so the sweep goes on and its report shows the failure as a
    row; a single run raises as usual. A stop signal (`guards.Preempted`) ends a sweep too.
    """
    try:
        return _run(cfg)
    except Exception as error:
        message = one_line(error) if isinstance(error, HydraException) else f"{type(error).__name__}: {error}"
        if dist.global_rank() == 0 and HydraConfig.initialized():
            report.write_json(Path(HydraConfig.get().runtime.output_dir) / "failed.json", {"error": message})
        if not _in_multirun():
            raise
        log.error("job failed: %s", message)
        return float("nan")


def _in_multirun() -> bool:
    return HydraConfig.initialized() and HydraConfig.get().mode == RunMode.MULTIRUN


def _run(cfg: DictConfig) -> float:
    settings = validate(cfg)  # every value is checked before any data is touched
    info = dist.dist_info_from_env()
    device = dist.resolve_device(settings.trainer.device, info)
    precision = resolve_precision(settings.trainer.precision, device)
    if not info.is_main:
        logging.getLogger().setLevel(logging.WARNING)  # other ranks print warnings and errors only
    dist.setup(info, device, settings.trainer.dist_timeout_s)
    try:
        summary = _train(cfg, settings, info, device, precision)
    finally:
        dist.teardown()
        if settings.trainer.compile:
            torch._dynamo.reset()  # the next job of a sweep compiles its own model, not this one's cached graphs
        gc.collect()  # shut down DataLoader workers and free memory before the next job of a sweep
        if device.type == "cuda":
            torch.cuda.empty_cache()
    value = summary.get(settings.optimized_metric)
    return float("nan") if value is None else float(value)


def _seed_everything(seed: int, deterministic: bool) -> None:
    """Seed every generator; cuDNN autotunes its convolutions unless the run must be reproducible."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)  # same on every rank: identical initial weights (DDP also broadcasts them)
    if deterministic:  # cuBLAS is reproducible only with a fixed workspace (read when its handle is made)
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(deterministic, warn_only=True)
    # benchmark: cuDNN times a few algorithms per input shape once, then keeps the fastest. The choice can
    # differ between runs, so a deterministic run keeps it off.
    torch.backends.cudnn.benchmark = not deterministic


@dataclass
class Loop:
    """What the training loop touches besides the model and the Step."""

    settings: Config
    meter: StepMeter
    monitor: ResourceMonitor
    logger: MetricsLogger
    progress: Progress
    total_steps: int
    replicas: int  # ranks the training order is sharded over (1 when each rank reads the whole set)
    signals: guards.StopSignals
    bad: guards.BadSampleBudget
    store: CheckpointStore
    save: Callable[[], str]  # writes last.pt at this step boundary; returns a sentence saying where it went
    nan_step: torch.Tensor | None = None  # trainer.nonfinite=stop: first step with a NaN/inf loss (-1: none), on device


def _train(cfg: DictConfig, settings: Config, info: dist.DistInfo, device: torch.device, precision: str) -> dict:
    started = time.perf_counter()
    trainer = settings.trainer
    out_dir = Path(dist.broadcast_object(settings.output_dir, info))  # rank 0's run directory, on every rank
    _seed_everything(trainer.seed, trainer.deterministic)
    bundle, train_loader, val_loader, loader_args = build_data(cfg, settings, info, device, out_dir)
    steps_per_epoch = len(train_loader)
    total_steps = min(trainer.epochs * steps_per_epoch, trainer.max_steps or math.inf)
    epochs = math.ceil(total_steps / steps_per_epoch)
    model, base, memory_format = build_model(cfg, settings, bundle.num_classes, device, info)
    step = make_step(
        cfg,
        settings,
        base,
        bundle,
        device=device,
        precision=precision,
        memory_format=memory_format,
        steps=(steps_per_epoch, total_steps),
        pinned=loader_args["train"]["pin_memory"],
        prefetch=loader_args["train"]["prefetch_to_device"],
        info=info,
    )
    log.info(
        "device %s, precision %s, world size %d, %d epoch(s) x %d steps (%d steps in all)",
        *(device, precision, info.world_size, epochs, steps_per_epoch, total_steps),
    )
    writes = settings.mode == "train" and trainer.save_checkpoints  # the ceiling modes measure speed only
    store = CheckpointStore(out_dir / checkpoint.DIRNAME, enabled=writes and info.is_main)
    progress = checkpoint.resume(settings, store, base, step, info)
    finished = out_dir / "metrics.json"
    if progress.step >= total_steps and finished.exists():
        log.info("this run already finished at step %d: %s is kept as it is", progress.step, finished)
        return json.loads(finished.read_text())
    sampler = getattr(train_loader, "sampler", None)
    loop = Loop(
        settings=settings,
        meter=StepMeter(trainer.warmup_steps),
        monitor=ResourceMonitor(device, trainer.monitor_interval_s).start(),
        # purge_step: TensorBoard hides what an interrupted run logged after the checkpoint it resumed from.
        logger=MetricsLogger(str(out_dir / "tb"), enabled=info.is_main, purge_step=progress.step + 1 or None),
        progress=progress,
        total_steps=total_steps,
        replicas=sampler.num_replicas if isinstance(sampler, EpochSampler) else 1,
        signals=guards.StopSignals(),
        bad=guards.BadSampleBudget(settings.data.max_bad_samples, progress.skipped_samples),
        store=store,
        save=lambda: _save(loop, cfg, base, step, writes, settings.data.batch_size * info.world_size),
    )
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    with loop.signals:
        try:
            for epoch in range(progress.epoch, epochs):
                _start_epoch(train_loader, progress, epoch, loop.replicas)
                completed = train_epoch(model, train_loader, step, loop)
                if settings.mode == "train":
                    _end_epoch(model, val_loader, step, loop, epochs=epochs, completed=completed)
                elif completed:
                    progress.epoch, progress.samples_in_epoch = epoch + 1, 0
        finally:
            loop.monitor.stop()
    summary = report.summarise(
        meter=loop.meter,
        monitor=loop.monitor,
        progress=progress,
        info=info,
        device=device,
        precision=precision,
        loader_args=loader_args,
        settings=settings,
        wall_time_s=time.perf_counter() - started,
    )
    report.finish(summary, loop.logger, out_dir / "metrics.json", write=info.is_main)
    return summary


def _save(loop: Loop, cfg, base: nn.Module, step: Step, writes: bool, global_batch: int) -> str:
    """Write last.pt, never with weights a NaN loss has already reached (trainer.nonfinite=stop)."""
    _stop_if_nonfinite(loop, step.device)
    return checkpoint.save(loop.store, writes, cfg, base, step, loop.progress, global_batch)


def _start_epoch(loader, progress: Progress, epoch: int, replicas: int) -> None:
    """Set the epoch's order (the same on every rank); a resumed epoch skips the samples already trained on."""
    if epoch != progress.epoch:
        progress.epoch, progress.samples_in_epoch = epoch, 0
    if isinstance(loader.sampler, EpochSampler):
        loader.sampler.set_epoch(epoch, start=progress.samples_in_epoch // replicas)


def _end_epoch(model: nn.Module, val_loader, step: Step, loop: Loop, *, epochs: int, completed: bool) -> None:
    """Validate, log, and write last.pt (and best.pt when accuracy improved).

    `completed` is False when trainer.max_steps ended the epoch early: the checkpoint then keeps that
    position, so a longer run continues from there.
    """
    progress = loop.progress
    progress.val = evaluate(model, val_loader, step, loop)
    loop.logger.log({"val/loss": progress.val["val_loss"], "val/acc": progress.val["val_acc"]}, progress.step)
    improved = progress.best_val_acc is None or progress.val["val_acc"] > progress.best_val_acc
    if improved:
        progress.best_val_acc = progress.val["val_acc"]
    log.info(
        "epoch %d/%d: val_loss %.4f  val_acc %.4f",
        *(progress.epoch + 1, epochs, progress.val["val_loss"], progress.val["val_acc"]),
    )
    if completed:
        progress.epoch, progress.samples_in_epoch = progress.epoch + 1, 0
    loop.save()
    if improved:
        loop.store.mark_best()


def train_epoch(model: nn.Module, loader, step: Step, loop: Loop) -> bool:
    """One pass over the training loader: wait for data, forward, backward, step. No GPU sync per step.

    Returns whether the epoch was completed (False when trainer.max_steps ended it early).
    """
    trainer, progress = loop.settings.trainer, loop.progress
    model.train()
    device = step.device
    loss_sum = torch.zeros((), device=device)  # running sums stay on the device until a logging window ends
    correct = torch.zeros((), device=device, dtype=torch.long)
    seen, window_steps = 0, 0  # images in loss_sum; steps in the open window
    remaining, done = len(loader), 0  # batches left in this epoch, and taken so far
    if trainer.nonfinite == "stop":
        loop.nan_step = torch.full((), -1, dtype=torch.long, device=device)
    bar = report.progress_bar(remaining, progress.epoch, trainer.progress_bar)
    loop.meter.start_window()
    with (
        guards.workers_stopped_on_error(iter(loader)) as loader_batches,
        step.batches(loader_batches) as batches,  # CUDA: the next batch's copy (or GPU decode) overlaps compute
    ):
        while progress.step < loop.total_steps:
            wait_start = time.perf_counter()
            batch = guards.next_batch(batches, loop.settings.data)  # blocks while no batch is ready: data wait
            if batch is None:
                break
            wait = time.perf_counter() - wait_start
            images, labels = step.to_device(batch.images, batch.labels)

            loss = None
            if step.mode != "loader":  # mode=loader measures the input pipeline and the copy alone
                with step.autocast():
                    logits = model(images)
                    loss = F.cross_entropy(logits, labels, label_smoothing=step.label_smoothing)
            # Every rank learns whether any rank got a stop signal or replaced unreadable images (and, with
            # trainer.nonfinite=skip, a NaN loss), so all take the same branch: DDP needs every rank in backward.
            check_loss = trainer.nonfinite == "skip"  # skip must know before the update: one GPU read per step
            flags = guards.agree(loss, loop.signals.received, len(batch.skipped), check_loss)
            if flags.nonfinite:
                _nonfinite_loss(loop, progress.step + 1)  # skip: no backward, no update
            elif loss is not None:
                step.optimizer.zero_grad(set_to_none=True)
                step.scaler.scale(loss).backward()
                step.scaler.step(step.optimizer)
                step.scaler.update()
                step.scheduler.step()
                loss_sum += loss.detach() * labels.shape[0]
                correct += (logits.argmax(dim=1) == labels).sum()
                seen += labels.shape[0]
                if loop.nan_step is not None:  # remembered on the device, read with the log window or a save
                    finite = torch.isfinite(loss.detach()) | (loop.nan_step >= 0)
                    loop.nan_step = torch.where(finite, loop.nan_step, progress.step + 1)

            progress.step += 1
            done += 1
            progress.samples_in_epoch += labels.shape[0] * loop.replicas
            loop.meter.add_step(labels.shape[0], wait)
            window_steps += 1
            bar.update(1)
            at_log_point = progress.step % trainer.log_every_n_steps == 0 or progress.step == trainer.warmup_steps
            if at_log_point and progress.step < loop.total_steps:
                _log_window(loop, step, loss_sum, correct, seen, bar)
                loss_sum.zero_(), correct.zero_()
                seen, window_steps = 0, 0
                loop.meter.start_window()
            _step_boundary(loop, flags, batch.skipped)  # unreadable images, stop signals, periodic checkpoints
    if window_steps:
        _log_window(loop, step, loss_sum, correct, seen, bar)
    bar.close()
    return done >= remaining


def _step_boundary(loop: Loop, flags: guards.StepFlags, skipped: tuple[str, ...]) -> None:
    """Act on what every rank agreed on: unreadable images, a stop signal, a periodic checkpoint."""
    progress, every = loop.progress, loop.settings.trainer.ckpt_every_n_steps
    loop.bad.report(skipped)  # this rank's files, by path
    if flags.skipped:
        loop.bad.add(flags.skipped)
        progress.skipped_samples = loop.bad.count
        if loop.bad.exceeded:
            raise loop.bad.error(_save_and_wait(loop))
    if flags.stop_signal:
        where = _save_and_wait(loop)
        name = signal.Signals(flags.stop_signal).name
        log.warning("%s: stopped at step %d. %s", name, progress.step, where)
        loop.signals.hand_over()  # submitit's handler (if any) requeues the job and exits here
        raise guards.Preempted(
            flags.stop_signal,
            f"{name} at step {progress.step}: {where} Run the same command again in the same run directory "
            "(hydra.run.dir=...) to continue, or pass trainer.resume=<checkpoint>",
        )
    if every and progress.step % every == 0 and progress.step < loop.total_steps:
        loop.save()


def _save_and_wait(loop: Loop) -> str:
    """Save at this boundary, and keep every rank until rank 0 has (so torchrun does not kill it mid-write)."""
    where = loop.save()
    dist.barrier()
    return where


def _stop_if_nonfinite(loop: Loop, device: torch.device) -> None:
    """trainer.nonfinite=stop: read the first step with a NaN/inf loss on any rank (one sync), and stop there."""
    if loop.nan_step is None:
        return
    first = [row[0] for row in dist.all_gather_floats([float(loop.nan_step.item())], device) if row[0] >= 0]
    if first:
        _nonfinite_loss(loop, int(min(first)))


def _nonfinite_loss(loop: Loop, at_step: int) -> None:
    progress = loop.progress
    progress.nonfinite_steps += 1
    if loop.settings.trainer.nonfinite == "stop":
        raise RunError(
            f"the training loss is NaN or infinite at step {at_step} (epoch {progress.epoch + 1}) and "
            f"trainer.nonfinite=stop. {_last_checkpoint(loop)} Lower optim.lr, try trainer.precision=fp32, or set "
            "trainer.nonfinite=skip"
        )
    log.warning("non-finite loss at step %d: step skipped (%d so far)", at_step, progress.nonfinite_steps)


def _last_checkpoint(loop: Loop) -> str:
    last = loop.store.last
    return f"The last good checkpoint is {last}." if last.exists() else "No checkpoint had been written yet."


def _log_window(loop: Loop, step: Step, loss_sum, correct, seen: int, bar) -> None:
    """Read the window's loss/accuracy (a .item() waits for the GPU), then log with one small collective."""
    meter, monitor, progress = loop.meter, loop.monitor, loop.progress
    _stop_if_nonfinite(loop, step.device)
    window = meter.close_window()
    metrics = {"lr": step.scheduler.get_last_lr()[0]}
    if seen:
        metrics.update({"train/loss": loss_sum.item() / seen, "train/acc": correct.item() / seen})
    if step.mode == "loader":
        metrics = {}  # no model: no loss, accuracy or learning rate
    metrics["data/skipped_samples"] = progress.skipped_samples
    if progress.nonfinite_steps:
        metrics["train/nonfinite_steps"] = progress.nonfinite_steps
    metrics.update(monitor.window())
    if step.device.type == "cuda":
        metrics["gpu/mem_peak_gb"] = torch.cuda.max_memory_allocated(step.device) / 1e9
    steady = window is not None and bool(meter.windows) and meter.windows[-1] is window
    if window is not None and not steady:
        monitor.reset_summary()  # a warm-up window just ended: resource means cover the steady state only
    # One small collective per logging window: throughput is summed over ranks, data wait is averaged and
    # its max kept (the slowest rank bounds a DDP step), GPU utilisation is kept per rank.
    mine = [window.images_per_sec, window.data_wait_frac, window.step_time_ms] if steady else [0.0, 0.0, 0.0]
    rows = dist.all_gather_floats([*mine, metrics.get("gpu/util_pct", -1.0)], step.device)
    if steady:
        metrics.update(
            {
                "perf/images_per_sec": sum(row[0] for row in rows),
                "perf/data_wait_frac": sum(row[1] for row in rows) / len(rows),
                "perf/step_time_ms": max(row[2] for row in rows),
            }
        )
        if len(rows) > 1:
            metrics["perf/data_wait_frac_max"] = max(row[1] for row in rows)
    if len(rows) > 1:
        metrics.update({f"gpu/util_pct/rank{r}": row[3] for r, row in enumerate(rows) if row[3] >= 0})
    loop.logger.log(metrics, progress.step)
    report.update_progress(bar, metrics, progress.step)


@torch.no_grad()
def evaluate(model: nn.Module, loader, step: Step, loop: Loop) -> dict[str, float]:
    """Top-1 accuracy and mean loss over the validation set, each sample counted once across ranks."""
    model.eval()
    totals = torch.zeros(4, device=step.device, dtype=torch.float64)  # loss sum, correct, count, unreadable
    with (
        guards.workers_stopped_on_error(iter(loader)) as loader_batches,
        step.batches(loader_batches, split="val") as batches,
    ):
        while (batch := guards.next_batch(batches, loop.settings.data)) is not None:
            loop.bad.report(batch.skipped)
            images, labels = step.to_device(batch.images, batch.labels)
            with step.autocast():
                logits = model(images)
            totals[0] += F.cross_entropy(logits.float(), labels, reduction="sum")
            totals[1] += (logits.argmax(dim=1) == labels).sum()
            totals[2] += labels.shape[0]
            totals[3] += len(batch.skipped)
    loss_sum, correct, count, unreadable = dist.all_reduce_sum(totals.tolist(), step.device)
    if unreadable:
        loop.bad.add(int(unreadable))
        loop.progress.skipped_samples = loop.bad.count
        if loop.bad.exceeded:
            raise loop.bad.error(_last_checkpoint(loop))
    return {"val_loss": loss_sum / max(count, 1), "val_acc": correct / max(count, 1), "val_count": int(count)}
