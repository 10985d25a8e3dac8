"""`run(cfg)`: set up, train, validate, report. The training loop is `train_epoch`, in one place."""

from __future__ import annotations

import contextlib
import gc
import itertools
import logging
import math
import random
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from hydra.core.hydra_config import HydraConfig
from hydra.errors import HydraException
from hydra.types import RunMode
from hydra.utils import instantiate
from omegaconf import DictConfig
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from imgtrain import dist, report
from imgtrain.cli import one_line
from imgtrain.config import AUTO, Config, ConfigError, validate
from imgtrain.loader import LoaderPlan, build_loader, plan_loader
from imgtrain.metrics import MetricsLogger
from imgtrain.models import count_parameters, param_groups, warmup_cosine
from imgtrain.monitor import ResourceMonitor
from imgtrain.perf import StepMeter

log = logging.getLogger(__name__)

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def resolve_precision(requested: str, device: torch.device) -> str:
    """`auto` is bf16 on CUDA GPUs that support it, else fp32; reject what the device cannot do."""
    cuda = device.type == "cuda"
    bf16_ok = cuda and torch.cuda.is_bf16_supported()
    if requested == AUTO:
        return "bf16" if bf16_ok else "fp32"
    if requested == "fp16" and not cuda:
        raise ConfigError("trainer.precision=fp16 needs a CUDA device: on CPU use fp32 or bf16")
    if requested == "bf16" and cuda and not bf16_ok:
        raise ConfigError("trainer.precision=bf16 is not supported by this GPU: use fp16 or fp32")
    return requested


@dataclass
class Step:
    """What the loop needs besides the model: built once, used every step."""

    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    scaler: torch.amp.GradScaler
    device: torch.device
    dtype: torch.dtype
    memory_format: torch.memory_format
    mean: torch.Tensor  # [1, 3, 1, 1] in 0..255 units, on the device
    std: torch.Tensor
    non_blocking: bool
    label_smoothing: float
    info: dist.DistInfo
    mode: str = "train"  # train; loader: input pipeline only, no model; compute: model only, one batch on device

    def to_device(self, images: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Copy a uint8 batch to the device, then convert and normalise there (4x fewer bytes than float)."""
        images = images.to(self.device, non_blocking=self.non_blocking)
        labels = labels.to(self.device, non_blocking=self.non_blocking)
        images = images.to(dtype=torch.float32, memory_format=self.memory_format)
        return (images - self.mean) / self.std, labels

    def autocast(self) -> contextlib.AbstractContextManager:
        return torch.autocast(self.device.type, dtype=self.dtype, enabled=self.dtype != torch.float32)


class DeviceBatches:
    """mode=compute: the same random uint8 batch, already on the device, `length` times per epoch."""

    sampler = None

    def __init__(self, batch: tuple[torch.Tensor, torch.Tensor], length: int) -> None:
        self.batch, self.length = batch, length

    @classmethod
    def random(cls, bundle: Any, batch_size: int, length: int, device: torch.device) -> DeviceBatches:
        size = (batch_size, 3, bundle.image_size, bundle.image_size)
        images = torch.randint(0, 256, size, dtype=torch.uint8, device=device)
        return cls((images, torch.randint(0, bundle.num_classes, (batch_size,), device=device)), length)

    def __len__(self) -> int:
        return self.length

    def __iter__(self):
        return itertools.repeat(self.batch, self.length)


def run(cfg: DictConfig) -> float:
    """Train as `cfg` says and return the metric named by `optimized_metric` (what a sweep optimises).

    In a multirun, a job that fails leaves `failed.json` (with the reason) and returns NaN, so the sweep goes
    on and its report shows the failure as a row; a single run raises as usual.
    """
    try:
        return _run(cfg)
    except Exception as error:
        if not _in_multirun():
            raise
        message = one_line(error) if isinstance(error, HydraException) else f"{type(error).__name__}: {error}"
        log.error("job failed: %s", message)
        if dist.global_rank() == 0:
            report.write_json(Path(HydraConfig.get().runtime.output_dir) / "failed.json", {"error": message})
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
        gc.collect()  # shut down DataLoader workers and free memory before the next job of a sweep
        if device.type == "cuda":
            torch.cuda.empty_cache()
    value = summary.get(settings.optimized_metric)
    return float("nan") if value is None else float(value)


def _seed_everything(seed: int, deterministic: bool) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)  # same on every rank: identical initial weights (DDP also broadcasts them)
    if deterministic:
        torch.use_deterministic_algorithms(True, warn_only=True)
        torch.backends.cudnn.benchmark = False


def _build_model(
    cfg: DictConfig, settings: Config, num_classes: int, device: torch.device, info: dist.DistInfo
) -> tuple[nn.Module, nn.Module, torch.memory_format]:
    """Return (model to call, underlying module for saving and param groups, input memory format)."""
    model = instantiate(cfg.model, num_classes=num_classes)
    channels_last = settings.trainer.channels_last
    if channels_last == AUTO:
        channels_last = device.type == "cuda"  # NHWC lets cuDNN use tensor-core convolutions directly
    memory_format = torch.channels_last if channels_last else torch.contiguous_format
    model = model.to(device, memory_format=memory_format)
    log.info("model: %s, %.1fM parameters, %s", settings.model.arch, count_parameters(model) / 1e6, memory_format)
    base = model
    if info.enabled:
        model = DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)
    if settings.trainer.compile:
        model = torch.compile(model)
    return model, base, memory_format


def _make_step(cfg, settings: Config, base: nn.Module, bundle: Any, **kw) -> Step:
    """Optimiser, LR schedule, scaler and input conversion; kw: device, precision, memory_format, steps, ..."""
    device, precision, memory_format, steps = kw["device"], kw["precision"], kw["memory_format"], kw["steps"]
    optimizer = instantiate(cfg.optim, params=param_groups(base, settings.optim.weight_decay), _convert_="all")
    steps_per_epoch, total_steps = steps
    warmup = round(settings.trainer.lr_warmup_epochs * steps_per_epoch)
    return Step(
        optimizer=optimizer,
        scheduler=warmup_cosine(optimizer, warmup, total_steps),
        scaler=torch.amp.GradScaler(device.type, enabled=precision == "fp16"),
        device=device,
        dtype=DTYPES[precision],
        memory_format=memory_format,
        mean=torch.tensor(bundle.mean, device=device).view(1, 3, 1, 1) * 255.0,
        std=torch.tensor(bundle.std, device=device).view(1, 3, 1, 1) * 255.0,
        non_blocking=kw["pinned"],  # an async copy needs page-locked memory; from pageable memory it is a sync copy
        label_smoothing=settings.trainer.label_smoothing,
        info=kw["info"],
        mode=settings.mode,
    )


def _plan_loaders(settings: Config, device: torch.device, info: dist.DistInfo) -> tuple[LoaderPlan, LoaderPlan]:
    common = {
        "device_type": device.type,
        "world_size": info.world_size,
        "local_world_size": info.local_world_size,
    }
    train_plan = plan_loader(settings.data, train=True, **common)
    val_plan = plan_loader(settings.data, train=False, **common)
    for note in train_plan.notes:
        log.warning(note) if note.startswith("data.num_workers=0") else log.info(note)
    log.info("DataLoader (train): %s", report.format_args(train_plan.describe()))
    log.info("DataLoader (val):   %s", report.format_args(val_plan.describe()))
    return train_plan, val_plan


def _build_data(cfg: DictConfig, settings: Config, info: dist.DistInfo, device: torch.device, out_dir: Path):
    """Dataset, train and val loaders, and the effective loader arguments (logged, and saved by rank 0)."""
    seed = settings.trainer.seed
    with dist.main_process_first(info):  # rank 0 generates `shapes` once; the others then reuse its files
        bundle = instantiate(cfg.dataset, _convert_="all")
    log.info(
        "dataset %s: %d train / %d val images, %d classes, %d px",
        *(bundle.name, len(bundle.train), len(bundle.val), bundle.num_classes, bundle.image_size),
    )
    train_plan, val_plan = _plan_loaders(settings, device, info)
    loader_args = {"train": train_plan.describe(), "val": val_plan.describe()}
    if info.is_main:
        report.write_json(out_dir / "loader_args.json", loader_args)
    shard = {"rank": info.rank, "world_size": info.world_size}
    train_loader = build_loader(bundle.train, train_plan, train=True, seed=seed, **shard)
    val_loader = build_loader(bundle.val, val_plan, train=False, seed=seed, **shard)
    if len(train_loader) == 0:
        raise ConfigError(
            f"data.batch_size={settings.data.batch_size} is larger than the training split of "
            f"{len(bundle.train)} images with data.drop_last=true: lower it or set drop_last=false"
        )
    if settings.mode == "compute":  # the compute ceiling: no loader at all, one batch already on the device
        train_loader = DeviceBatches.random(bundle, train_plan.kwargs["batch_size"], len(train_loader), device)
    return bundle, train_loader, val_loader, loader_args


def _train(cfg: DictConfig, settings: Config, info: dist.DistInfo, device: torch.device, precision: str) -> dict:
    started = time.perf_counter()
    trainer = settings.trainer
    out_dir = Path(dist.broadcast_object(settings.output_dir, info))  # rank 0's run directory, on every rank
    _seed_everything(trainer.seed, trainer.deterministic)
    bundle, train_loader, val_loader, loader_args = _build_data(cfg, settings, info, device, out_dir)
    steps_per_epoch = len(train_loader)
    total_steps = min(trainer.epochs * steps_per_epoch, trainer.max_steps or math.inf)
    epochs = math.ceil(total_steps / steps_per_epoch)
    model, base, memory_format = _build_model(cfg, settings, bundle.num_classes, device, info)
    step = _make_step(
        cfg,
        settings,
        base,
        bundle,
        device=device,
        precision=precision,
        memory_format=memory_format,
        steps=(steps_per_epoch, total_steps),
        pinned=loader_args["train"]["pin_memory"],
        info=info,
    )
    log.info(
        "device %s, precision %s, world size %d, %d epoch(s) x %d steps (%d steps in all)",
        device,
        precision,
        info.world_size,
        epochs,
        steps_per_epoch,
        total_steps,
    )

    logger = MetricsLogger(str(out_dir / "tb"), enabled=info.is_main)
    monitor = ResourceMonitor(device, trainer.monitor_interval_s).start()
    meter = StepMeter(trainer.warmup_steps)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    state = {"step": 0, "val": {}}
    try:
        for epoch in range(epochs):
            if isinstance(train_loader.sampler, torch.utils.data.DistributedSampler):
                train_loader.sampler.set_epoch(epoch)  # a different shuffle every epoch, the same on every rank
            train_epoch(model, train_loader, step, meter, monitor, logger, state, epoch, total_steps, settings)
            if settings.mode != "train":
                continue  # the ceiling modes measure speed only
            state["val"] = evaluate(model, val_loader, step)
            logger.log({"val/loss": state["val"]["val_loss"], "val/acc": state["val"]["val_acc"]}, state["step"])
            state["best_val_acc"] = max(state.get("best_val_acc", 0.0), state["val"]["val_acc"])
            log.info(
                "epoch %d/%d: val_loss %.4f  val_acc %.4f",
                epoch + 1,
                epochs,
                state["val"]["val_loss"],
                state["val"]["val_acc"],
            )
    finally:
        monitor.stop()
    summary = report.summarise(
        meter=meter,
        monitor=monitor,
        state=state,
        info=info,
        device=device,
        precision=precision,
        loader_args=loader_args,
        settings=settings,
        wall_time_s=time.perf_counter() - started,
    )
    summary["verdict"] = report.verdict(summary)
    if info.is_main:
        report.write_json(out_dir / "metrics.json", summary)
        logger.log_hparams(report.hparams(summary), report.hparam_metrics(summary))
        report.print_table(summary)
    logger.close()
    return summary


def train_epoch(model, loader, step: Step, meter: StepMeter, monitor, logger, state, epoch, total_steps, settings):
    """One pass over the training loader: wait for data, forward, backward, step. Syncs only to log."""
    trainer = settings.trainer
    model.train()
    device = step.device
    loss_sum = torch.zeros((), device=device)  # running sums stay on the device: no sync per step
    correct = torch.zeros((), device=device, dtype=torch.long)
    seen = 0
    bar = report.progress_bar(len(loader), epoch, trainer.progress_bar)
    meter.start_window()
    batches = iter(loader)
    while state["step"] < total_steps:
        wait_start = time.perf_counter()
        batch = next(batches, None)  # blocks while the workers have no batch ready: that is data wait
        if batch is None:
            break
        wait = time.perf_counter() - wait_start
        images, labels = step.to_device(*batch)

        if step.mode != "loader":  # mode=loader measures the input pipeline and the copy alone
            with step.autocast():
                logits = model(images)
                loss = F.cross_entropy(logits, labels, label_smoothing=step.label_smoothing)
            step.optimizer.zero_grad(set_to_none=True)
            step.scaler.scale(loss).backward()
            step.scaler.step(step.optimizer)
            step.scaler.update()
            step.scheduler.step()
            loss_sum += loss.detach() * labels.shape[0]
            correct += (logits.argmax(dim=1) == labels).sum()

        state["step"] += 1
        meter.add_step(labels.shape[0], wait)
        seen += labels.shape[0]
        bar.update(1)
        at_log_point = state["step"] % trainer.log_every_n_steps == 0 or state["step"] == trainer.warmup_steps
        if at_log_point and state["step"] < total_steps:
            _log_window(meter, monitor, logger, state["step"], step, loss_sum, correct, seen, bar)
            loss_sum.zero_(), correct.zero_()
            seen = 0
            meter.start_window()
    if seen:
        _log_window(meter, monitor, logger, state["step"], step, loss_sum, correct, seen, bar)
    bar.close()


def _log_window(meter, monitor, logger, global_step: int, step: Step, loss_sum, correct, seen: int, bar) -> None:
    """The one sync point: read the window's loss/accuracy (a .item() waits for the GPU), then log."""
    train_loss = loss_sum.item() / seen
    train_acc = correct.item() / seen
    window = meter.close_window()
    metrics = {"train/loss": train_loss, "train/acc": train_acc, "lr": step.scheduler.get_last_lr()[0]}
    if step.mode == "loader":
        metrics = {}  # no model: no loss, accuracy or learning rate
    metrics.update(monitor.window())
    if step.device.type == "cuda":
        metrics["gpu/mem_peak_gb"] = torch.cuda.max_memory_allocated(step.device) / 1e9
    steady = window is not None and bool(meter.windows) and meter.windows[-1] is window
    if window is not None and not steady:
        monitor.reset_summary()  # a warm-up window just ended: resource means cover the steady state only
    # One small collective per logging window (never per step): throughput is summed over ranks, data wait is
    # averaged and its max kept (the slowest rank bounds a DDP step), GPU utilisation is kept per rank.
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
    logger.log(metrics, global_step)
    report.update_progress(bar, metrics, global_step)


@torch.no_grad()
def evaluate(model: nn.Module, loader, step: Step) -> dict[str, float]:
    """Top-1 accuracy and mean loss over the validation set, each sample counted once across ranks."""
    model.eval()
    totals = torch.zeros(3, device=step.device, dtype=torch.float64)  # loss sum, correct, count
    for batch in loader:
        images, labels = step.to_device(*batch)
        with step.autocast():
            logits = model(images)
        totals[0] += F.cross_entropy(logits.float(), labels, reduction="sum")
        totals[1] += (logits.argmax(dim=1) == labels).sum()
        totals[2] += labels.shape[0]
    loss_sum, correct, count = dist.all_reduce_sum(totals.tolist(), step.device)
    return {"val_loss": loss_sum / max(count, 1), "val_acc": correct / max(count, 1), "val_count": int(count)}
