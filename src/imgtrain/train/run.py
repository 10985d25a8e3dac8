"""`run(cfg)`: validate the config once, build the run's parts, train (`loop.fit`), report."""

from __future__ import annotations

import contextlib
import functools
import gc
import logging
import math
import os
import random
import time
from pathlib import Path

import numpy as np
import torch
from hydra.core.hydra_config import HydraConfig
from hydra.errors import HydraException
from hydra.types import RunMode
from omegaconf import DictConfig

from imgtrain.common.atomic import BadJSON, read_json, write_json
from imgtrain.common.disk import disk_full_line, is_disk_full
from imgtrain.common.errors import ConfigError, RunError, is_bad_input
from imgtrain.config.fields import TUNE
from imgtrain.config.schema import Config, Mode
from imgtrain.config.validate import validate
from imgtrain.data import streamed
from imgtrain.data.pipeline import RunData, build_data, save_loader_args
from imgtrain.host import dist
from imgtrain.metrics import Metrics
from imgtrain.metrics.preflight import preflight
from imgtrain.metrics.profiling import Profiler
from imgtrain.metrics.spread import MIN_WINDOWS, Rate
from imgtrain.metrics.stage_breakdown import PipelineMeter
from imgtrain.resilience import rundir
from imgtrain.resilience.agreement import LoggingWindows
from imgtrain.resilience.checkpoint import Checkpointer
from imgtrain.resilience.faults import Faults, Preempted, restore_after_ending
from imgtrain.sweep.jobs import STOPPED
from imgtrain.sweep.report import build_report
from imgtrain.train import tune
from imgtrain.train.cli import one_line
from imgtrain.train.instruments import Instruments, RunEnd
from imgtrain.train.loop import Components, fit
from imgtrain.train.placement import check_model, memory_format_for, prepare_model, resolve_precision
from imgtrain.train.probe import ModelProbe
from imgtrain.train.step import build_step

log = logging.getLogger(__name__)


class NotMeasured(str):
    """A job's objective when it has no figure (a failed job, or one too short to measure): the reason.

    Not NaN, so that the reason travels with it: hparams_search's sweeper (src/hydra_plugins/imgtrain_optuna) tells
    Optuna such a trial failed, logs this text, and the search goes on (conf/hparams_search sets max_failure_rate
    so that such trials are no error). The basic sweeper ignores the value; the sweep report lists the job with
    its reason either way."""


def run(cfg: DictConfig) -> float | NotMeasured:
    """Train as `cfg` says and return the metric named by `optimized_metric` (what a sweep optimises), or why
    there is none (NotMeasured).

    A job that fails leaves `failed.json` (with the reason) in its run directory, so nothing there looks like a
    finished run. In a multirun it then returns NotMeasured, so the sweep goes on and its report shows the failure
    as a row; a single run raises as usual. A stop signal (`faults.Preempted`) ends a sweep too.
    """
    try:
        settings = validate(cfg)  # every value is checked before any data is touched
        check_model(settings.model)  # and the model's name (imports torchvision's registry or timm): one line
        summary = _run(settings)
    except Preempted as stop:
        _end_sweep(stop)
        raise
    except Exception as error:
        failure = _full_disk(error)
        message = one_line(failure) if isinstance(failure, HydraException) else f"{type(failure).__name__}: {failure}"
        unwritten = _write_failed(message)  # on a full disk it fails too: said in the same line
        if unwritten is not None:
            message = f"{message}; {unwritten}"
            if isinstance(failure, HydraException):
                failure = (ConfigError if is_bad_input(failure) else RunError)(message)
            else:  # a bug, which keeps its traceback: this says the rest
                log.error("%s", unwritten)
        if not (HydraConfig.initialized() and HydraConfig.get().mode == RunMode.MULTIRUN):
            if failure is error:
                raise
            raise failure from error
        log.error("job failed: %s", message)
        return NotMeasured(f"the job failed: {message}")
    finally:
        restore_after_ending()  # the stop handlers a run ending with an exception kept while it cleaned up
    metric = str(settings.optimized_metric)
    value = summary.get(metric)
    if value is None or not math.isfinite(float(value)):
        why = summary.get(f"{metric}_note") or f"the run gives {metric}={value} (mode={settings.mode})"
        why = why.removeprefix("not measured: ")
        if HydraConfig.initialized() and HydraConfig.get().mode == RunMode.MULTIRUN:  # a sweep's objective
            log.warning("%s not measured: %s", metric, why)
        return NotMeasured(f"{metric} not measured: {why}")
    return float(value)


def _full_disk(error: Exception) -> Exception:
    """A full disk met where no part of the run said so (an OSError, a traceback): one line naming the disk and
    its free space. Every other error as it is."""
    if isinstance(error, HydraException) or not is_disk_full(error):
        return error
    full: BaseException | None = error
    while full is not None and not (isinstance(full, OSError) and full.filename):
        full = full.__cause__ or full.__context__
    if full is None:  # no file named (a write to an open file): the run directory, where the run writes
        where = HydraConfig.get().runtime.output_dir if HydraConfig.initialized() else None
        return RunError(f"a file in {where} could not be written: {disk_full_line(where, error)}") if where else error
    return RunError(f"{full.filename} could not be written: {disk_full_line(full.filename, error)}")


def _write_failed(message: str) -> str | None:
    """Rank 0 of a Hydra run writes `failed.json` with `message`; None, or why it could not (a full disk)."""
    if dist.global_rank() != 0 or not HydraConfig.initialized():
        return None
    path = Path(HydraConfig.get().runtime.output_dir) / "failed.json"
    try:
        write_json(path, {"error": message})
    except OSError as error:
        return f"{path} could not be written either ({error.strerror or error})"
    return None


def _end_sweep(stop: Preempted) -> None:
    """In a multirun a stop signal ends the sweep: the stopped job says so (`stopped.json`, beside its checkpoint)
    and the jobs that finished get their report now, as Hydra's on_multirun_end would have written it. A submitit job
    (hydra/launcher=slurm) only says so: its launcher waits for the requeued attempt, or ends the sweep itself."""
    if not (HydraConfig.initialized() and HydraConfig.get().mode == RunMode.MULTIRUN) or dist.global_rank() != 0:
        return
    write_json(Path(HydraConfig.get().runtime.output_dir) / STOPPED, {"error": stop.line})
    if "SUBMITIT_EXECUTOR" in os.environ:  # a job of its own (Slurm may requeue it): its launcher ends the sweep
        return
    log.warning("the sweep ends here: the report covers the jobs before this one")
    build_report(Path(HydraConfig.get().sweep.dir))


def _run(settings: Config) -> dict:
    info = dist.dist_info_from_env()
    device = dist.resolve_device(settings.system.device, info)
    precision = resolve_precision(settings.system.precision, device)
    if not info.is_main:
        logging.getLogger().setLevel(logging.WARNING)  # other ranks print warnings and errors only
    dist.setup(info, device, settings.faults.dist_timeout_s)
    try:
        started = time.perf_counter()
        out_dir = Path(dist.broadcast_plain(settings.output_dir, info))  # rank 0's run directory, on every rank
        with rundir.hold(out_dir, info):  # one writer per run directory: another run there stops here, with one line
            return _train_locked(settings, info, device, precision, out_dir, started)
    except RuntimeError as error:
        lost = dist.lost_peer(error, info)  # another rank failed first: one line here, its own reason there
        if lost is None:
            raise
        raise lost from error
    finally:
        dist.teardown()
        if settings.system.compile:
            torch._dynamo.reset()  # the next job of a sweep compiles its own model, not this one's cached graphs
        streamed.close_all()  # dataset=shards: LitData's workers, before the collector could lose their shutdown
        gc.collect()  # shut down DataLoader workers and free memory before the next job of a sweep
        if device.type == "cuda":
            torch.cuda.empty_cache()


def seed_everything(seed: int, deterministic: bool) -> None:
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


def _train_locked(
    settings: Config, info: dist.DistInfo, device: torch.device, precision: str, out_dir: Path, started: float
) -> dict:
    seed_everything(settings.train.seed, settings.system.deterministic)
    memory_format = memory_format_for(settings.system.channels_last, device)
    data = build_data(settings, info, device, memory_format, out_dir)  # num_workers=tune: no training loader yet
    model, base = prepare_model(settings, data.bundle.num_classes, device, memory_format, info)
    # the model's own images/s in `seconds`: a copy of it, compiled as the run's, on a batch already on the device
    model_rate = ModelProbe(base, data.bundle.num_classes, settings, device, precision, memory_format)
    if settings.data.num_workers == TUNE:
        _tune_workers(settings, data, info, device, model_rate, out_dir)
        model_rate.release()  # its copy, optimizer state and compiled code: the model compiles its own graph
    steps_per_epoch = len(data.train)
    total_steps = min(settings.train.epochs * steps_per_epoch, settings.train.max_steps or math.inf)
    epochs = math.ceil(total_steps / steps_per_epoch)
    environment = preflight(settings, info, device, data)  # warns of limits the loaders will likely hit
    # memory_format: mixed batches go back to the model's (on CUDA MixUp's output is NCHW, train/mixing.py)
    keys = {"num_classes": data.bundle.num_classes, "world_size": info.world_size, "memory_format": memory_format}
    step = build_step(settings, base, device, precision, (steps_per_epoch, total_steps), **keys)
    log.info(
        "device %s, precision %s, world size %d, %d epoch(s) x %d steps (%d steps in all)",
        *(device, precision, info.world_size, epochs, steps_per_epoch, total_steps),
    )
    faults = Faults(settings.faults.nonfinite, settings.data.max_bad_samples, device, alone=not info.enabled)
    faults.left_out(data.left_out)
    checkpointer = Checkpointer(settings, out_dir, info, faults)
    faults.signals.last_checkpoint = checkpointer.last_checkpoint  # what a second Ctrl-C names as it exits
    checkpointer.attach(base, step, total_steps, order=data.order)
    progress = checkpointer.resume(replicas=data.replicas)  # the loop's position: only the loop writes it
    total_steps = checkpointer.total_steps  # where the loop ends: a resumed run's batch change moves it
    finished = out_dir / "metrics.json"
    if progress.step >= total_steps and finished.exists():
        log.info("this run already finished at step %d: %s is kept as it is", progress.step, finished)
        return _finished_summary(finished, progress.step)
    measuring = instruments_for(settings, info, device, out_dir, data, faults, environment, total_steps - progress.step)
    instruments = Instruments(measuring)
    # the ranks' one exchange per logging window: the loop's own, whatever measures the run
    every = settings.metrics.log_every_n_steps
    windows = LoggingWindows(every, total_steps, [faults, checkpointer], also_at=instruments.window_ends())
    parts = Components(faults, instruments, checkpointer, progress, windows)
    lr = lambda: step.scheduler.get_last_lr()[0]  # noqa: E731
    running = instruments.running(progress.step, total_steps, lr=lr)
    with contextlib.closing(data), faults, checkpointer.writing(), running:  # closing: workers stop now
        fit(model, data, step, parts, settings.mode, epochs)
    own_rate = functools.partial(_own_rate, settings, data, device, model_rate)  # (wait_frac, busy_cores) -> rate
    return instruments.finish(RunEnd(progress, precision, data.loader_args, started, own_rate), finished)


def instruments_for(
    settings: Config,
    info: dist.DistInfo,
    device: torch.device,
    out_dir: Path,
    data: RunData,
    faults: Faults,
    environment: dict,
    steps_left: int,
) -> list:
    """What measures the run, in one list (`train/instruments.py`): the run trains the same, alone and under DDP,
    with an entry deleted, or with none (then no metrics.json: `run` returns the steps and validation figures)."""
    profiler = Profiler(settings.metrics, device, info, out_dir, steps_left=steps_left)
    pipeline = PipelineMeter(data.loader_args["train"]["num_workers"], data.feed.copy_timer, data.feed.decode_timer)
    # the profiled steps run slower: the metrics leave them out of the steady state (none without metrics.profile)
    measured = {"pipeline": pipeline, "environment": environment, "profiled_steps": profiler.profiled_steps}
    measured["train_set"] = data.bundle.train  # a decode-bound verdict times some of its files (decode_sample.py)
    return [
        Metrics(settings, device, info, out_dir, faults, **measured),  # windows, TensorBoard, bar, metrics.json
        profiler,  # metrics.profile=true: a Perfetto trace of a few steady-state steps
    ]


def _finished_summary(path: Path, step: int) -> dict:
    """The summary a finished run wrote, returned again; one line when what is there now cannot be."""
    try:
        summary = read_json(path)
        if not isinstance(summary, dict):
            raise BadJSON(str(path), f"it holds a {type(summary).__name__}, not a run's summary")
    except (BadJSON, OSError) as error:
        why = error if isinstance(error, BadJSON) else f"{path} cannot be read ({error.strerror or error})"
        raise RunError(
            f"this run already finished (step {step}), but {why}: delete it to write it again (the last checkpoint "
            "validated again, without speed figures), or pass another hydra.run.dir"
        ) from None
    return summary


def _tune_workers(
    settings: Config,
    data: RunData,
    info: dist.DistInfo,
    device: torch.device,
    model_rate: ModelProbe,
    out_dir: Path,
) -> None:
    """data.num_workers=tune: probe, then build the training loader (once) with the chosen count; auto's count where
    build_data built it already (no loader to probe: mode=loader or compute, data.device_resident)."""
    if data.train is not None:
        why = f"mode={settings.mode}" if settings.mode != Mode.train else "data.device_resident=true"
        log.info("data.num_workers=tune: nothing to probe with %s; keeping auto's count", why)
        return
    model_rate.ready()  # compiled and warmed up before the tuning clock starts
    try:
        fed = model_rate.step_on if device.type == "cuda" else None  # on a GPU: each count timed training (tune.py)
        tuned = tune.tune_workers(data.bundle.train, settings, data.train_plan, data.feed, info, model_rate, fed)
    except (RuntimeError, OSError) as error:  # a probe's workers failed: training would say why, with its count
        log.warning("data.num_workers=tune: the probe failed (%s); keeping auto's count", one_line(error))
        data.build_train(data.loader_args["train"]["num_workers"])  # the count planned before the probe
        return
    data.build_train(tuned["chosen"], tuned)
    save_loader_args(data, info, out_dir)


def _own_rate(
    settings: Config,
    data: RunData,
    device: torch.device,
    model_rate: ModelProbe,
    wait_frac: float | None,
    busy_cores: float,
) -> Rate | None:
    """The model's own images/s, for telling CPU contention from compute-bound: the tune probe's, or timed now
    (with the workers idle) when metrics.compute_probe says so, given this rank's steady data-wait share
    (`wait_frac`, None: not measured) and the CPU cores its loading kept busy."""
    tuned = data.loader_args.get("tune")
    if tuned:
        return Rate.read(tuned, "compute_images_per_sec", samples=tuned["rounds"])
    workers = data.loader_args["train"]["num_workers"]
    probe = settings.metrics.compute_probe
    if settings.mode != Mode.train or not tune.contention_plausible(probe, wait_frac, busy_cores, workers, device):
        return None
    rate = model_rate(tune.CONTENTION_PROBE_S, MIN_WINDOWS)  # steps enough for an interval
    model_rate.release()
    log.info("the model alone (a copy, on a batch already on %s): %s", device, rate.text(of="steps"))
    return rate
