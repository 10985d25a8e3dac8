"""The run's one metrics component, in the spirit of torchtitan's MetricsProcessor: an instrument of the loop
(the hooks of `train/instruments.py`'s `Instrument`, by name).

It owns the step windows, the resource monitor, TensorBoard, the progress bar and the end-of-run summary, and
reduces across ranks in one place. The loop hands it each step's loss on the device; it reads numbers back
only when a logging window ends (`window_report`: the window's one sync), and its figures then travel in that
window's `agreement.WindowReport`, which the loop exchanges; `on_window` logs what the ranks agreed on.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torchvision

from imgtrain.common.atomic import write_json
from imgtrain.config.model import model_name
from imgtrain.config.schema import Config, Mode
from imgtrain.data.decode_sample import sample_decodes
from imgtrain.host import dist
from imgtrain.host.cpus import available_cpus
from imgtrain.metrics.console import print_table, progress_bar, update_progress
from imgtrain.metrics.epoch_start import EpochStarts
from imgtrain.metrics.monitor import ResourceMonitor
from imgtrain.metrics.report import bounding_stage, decode_bound, too_few_windows, verdict, why_not_measured
from imgtrain.metrics.spread import Rate
from imgtrain.metrics.stage_breakdown import PipelineMeter
from imgtrain.metrics.summary import RunSummary, as_json
from imgtrain.metrics.tensorboard import MetricsLogger, hparam_metrics, hparams
from imgtrain.metrics.windows import StepMeter
from imgtrain.resilience.agreement import Agreement, WindowReport, exchange
from imgtrain.resilience.faults import Faults

UNREADABLE_LISTED = 100  # distinct unreadable files listed in metrics.json (all are counted)

log = logging.getLogger(__name__)


class Metrics:
    """Windows, monitor, TensorBoard (rank 0), progress bar and summary for one run."""

    def __init__(
        self,
        settings: Config,
        device: torch.device,
        info: dist.DistInfo,
        out_dir: Path,
        faults: Faults,
        pipeline: PipelineMeter | None = None,
        environment: dict[str, Any] | None = None,
        profiled_steps: int = 0,
        train_set: Any = None,
    ):
        self.settings, self.device, self.info, self.faults = settings, device, info, faults
        self.train_set = train_set  # the training split's Dataset: a decode-bound verdict times some of its files
        self.environment = environment  # the pre-flight fingerprint (preflight.py)
        # `profiled_steps` (metrics.profile=true) follow the warm-up steps and stay out of the steady state too
        self.profiled_steps = profiled_steps
        self.log_every, self.warmup_steps = settings.metrics.log_every_n_steps, settings.metrics.skip_first_steps
        self.warmup_steps += profiled_steps
        self.losses = settings.mode != Mode.loader  # mode=loader's stand-in model has no loss worth showing
        self.meter = StepMeter(self.warmup_steps)
        self.pipeline = pipeline or PipelineMeter(workers=0)
        self.monitor = ResourceMonitor(device, settings.metrics.monitor_interval_s)
        self.tb_dir = str(out_dir / "tb")
        self.tb: MetricsLogger | None = None
        self.bar: Any = None
        self.lr, self.start_step = lambda: 0.0, 0
        self.sums = torch.zeros(3, device=device, dtype=torch.float64)  # loss x images, correct, images
        self.wait = 0.0  # seconds waited for the next batch since the last step
        self.epoch_starts, self.steps_per_epoch = EpochStarts(), 0
        self.first_batch_s: float | None = None  # this epoch's, logged with its first window
        self.closing: tuple[dict[str, float], bool] = ({}, False)  # a window's values, steady: report to agree

    def failure_notes(self) -> str:
        return self.memory_peaks()

    def memory_peaks(self) -> str:
        """This run's memory peaks so far (this process and its workers), for a message about memory."""
        peaks = self.monitor.summary()
        named = (("RSS", peaks["rss_peak_gb"]), ("PSS", peaks["pss_peak_gb"]))
        shown = [f"{name} {gb:.2f} GB" for name, gb in named if gb is not None]
        return f"Memory peaks of this process and its workers: {', '.join(shown)}." if shown else ""

    def on_run_start(self, start_step: int, total_steps: int, lr: Callable[[], float]) -> None:
        """Sample resources and write TensorBoard while training; `lr` reads the current learning rate."""
        self.lr, self.start_step = lr, start_step
        # purge_step: TensorBoard hides what an interrupted run logged after the checkpoint it resumed from.
        self.tb = MetricsLogger(self.tb_dir, enabled=self.info.is_main, purge_step=start_step + 1 or None)
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        self.monitor.start()

    def on_run_end(self) -> None:
        self.monitor.stop()

    # ------------------------------------------------------------------ during an epoch
    def on_epoch_start(self, epoch: int, steps: int) -> None:
        self.bar = progress_bar(steps, epoch, self.settings.metrics.progress_bar)
        self.sums.zero_()
        self.wait = 0.0
        self.pipeline.discard_copies()
        self.meter.start_window()
        self.epoch_starts.begin()  # the epoch-start stall is timed from here to the first batch and window
        self.steps_per_epoch = steps

    def on_batch(self, wait: float, transfer: float, times: tuple) -> None:
        """A batch the loop received after blocking `wait` s, `transfer` s of it after a worker had finished it,
        with the stage times its worker stamped on it (the batch iterator calls this)."""
        self.wait += wait
        self.pipeline.add(wait, transfer, times)
        self.first_batch_s = self.epoch_starts.batch_arrived() or self.first_batch_s

    def on_step_end(self, step: int, loss: torch.Tensor, logits: torch.Tensor, labels: torch.Tensor) -> None:
        """Count one step, on the device: nothing is read back until the window ends (`window_report`)."""
        if self.losses:  # on the device, no sync; a NaN/inf loss (skipped or about to stop the run) is left out
            loss = loss.detach().double()
            finite = torch.isfinite(loss)
            images = finite.double() * labels.shape[0]
            correct = (logits.argmax(dim=1) == labels).sum().double() * finite
            self.sums += torch.stack([torch.where(finite, loss, 0.0) * images, correct, images])
        self.meter.add_step(labels.shape[0], self.wait)
        self.wait = 0.0
        self.bar.update(1)

    def window_ends(self) -> tuple[int, ...]:
        """The warm-up's end: the steady windows start there."""
        return (self.warmup_steps,)

    def on_epoch_end(self, step: int) -> None:
        """The epoch's last, partial window has ended (every rank has one at the same step)."""
        self.bar.close()

    def on_eval(self, values: dict[str, float], step: int) -> None:
        self.tb.log(values, step)

    def window_report(self, step: int) -> dict[str, float]:
        """Close the window: read everything back (its one sync); this rank's figures for the exchange."""
        loss_images, correct, seen = self.sums.tolist()  # the one sync of the window
        window = self.meter.close_window()
        values: dict[str, float] = self._epoch_start(window)
        if self.losses:
            values["lr"] = self.lr()
            if seen:
                values.update({"train/loss": loss_images / seen, "train/acc": correct / seen})
        values.update(self.monitor.window())
        if self.device.type == "cuda":
            values["gpu/mem_peak_gb"] = torch.cuda.max_memory_allocated(self.device) / 1e9
        steady = window is not None and bool(self.meter.windows) and self.meter.windows[-1] is window
        if window is not None and not steady:
            self.monitor.reset_summary()  # a warm-up window just ended: resource means cover the steady state only
        if window is not None:
            values.update(self.pipeline.close_window(window.seconds, steady))
        perf = {"gpu_util_pct": values.get("gpu/util_pct", -1.0)}
        if steady:  # a warm-up window sends zeros: the merged figures are read for steady windows only
            perf |= {"images_per_sec": window.images_per_sec, "data_wait_frac": window.data_wait_frac}
            perf["step_time_ms"] = window.step_time_ms
            values["perf/main_thread_busy_frac"] = window.cpu_seconds / window.seconds if window.seconds else 0.0
        self.closing = (values, steady)
        return perf

    def on_window(self, step: int, agreed: Agreement) -> None:
        """Log the window `window_report` closed, with what the ranks agreed on; open the next."""
        values, steady = self.closing
        self.closing = ({}, False)
        counts = self.faults.counts
        values["data/skipped_samples"] = counts.skipped_samples
        if counts.nonfinite_steps:
            values["train/nonfinite_steps"] = counts.nonfinite_steps
        if steady:
            keys = ("images_per_sec", "data_wait_frac", "step_time_ms")
            values.update({f"perf/{key}": getattr(agreed, key) for key in keys})
            if self.info.world_size > 1:
                values["perf/data_wait_frac_max"] = agreed.data_wait_frac_max
        if self.info.world_size > 1:
            values.update({f"gpu/util_pct/rank{r}": u for r, u in enumerate(agreed.gpu_util_per_rank) if u})
        self.tb.log(values, step)
        update_progress(self.bar, values, step)
        self.sums.zero_()
        self.meter.start_window()

    def _epoch_start(self, window: Any) -> dict[str, float]:
        """At an epoch's first window: its first-batch wait and, after this process's first epoch, its cost."""
        if not self.epoch_starts.window_closed(window):
            return {}
        values = {} if self.first_batch_s is None else {"time/epoch_first_batch_s": self.first_batch_s}
        self.first_batch_s = None
        cost = self.epoch_starts.cost(window.steps, window.seconds, self.meter.steady_step_s())
        if len(self.epoch_starts.first_windows) > 1 and cost is not None:
            values["time/epoch_start_cost_s"] = cost
        return values

    # ------------------------------------------------------------------ the end of the run
    def local_input_load(self) -> tuple[float | None, float]:
        """This rank's steady-state data-wait share (None: not measured) and CPU cores its loading kept busy."""
        steady = self.pipeline.steady
        busy_cores = steady["busy"] / steady["seconds"] if steady["seconds"] else 0.0
        return self.meter.summary()["data_wait_frac"], busy_cores

    def summary(self, end: Any) -> dict[str, Any]:
        """The run's final figures (`summary.RunSummary`, as a dict), reduced over ranks (every rank must call
        it), from `end` (train/instruments.py's `RunEnd`: progress, precision, loader args, the start time, and
        the model's own rate, timed now if this rank's input load suggests contention). `profile_trace` is the
        profiler's to fill."""
        progress, precision, loader_args = end.progress, end.precision, end.loader_args
        compute: Rate | None = end.own_rate(*self.local_input_load())
        wall_time_s = time.perf_counter() - end.started  # after the probe, as the run's wall time includes it
        self.faults.merge_unreadable()
        perf, resources = self.meter.summary(), self.monitor.summary()
        measured, util = perf["images_per_sec"] is not None, resources.get("gpu_util_mean")
        mine = {"images_per_sec": perf["images_per_sec"] or 0.0, "data_wait_frac": perf["data_wait_frac"] or 0.0}
        merged = exchange(WindowReport(**mine, gpu_util_pct=-1.0 if util is None else util))
        val, counts, cuda = progress.val, self.faults.counts, self.device.type == "cuda"
        unreadable = list(counts.unreadable_files.items())[:UNREADABLE_LISTED]
        summary = RunSummary(
            status="ok",
            mode=self.settings.mode,
            **self._throughput(perf, merged.images_per_sec if measured else None, progress.step),
            **self.epoch_starts.summary(self.meter.steady_step_s(), self.steps_per_epoch),
            data_wait_frac=merged.data_wait_frac if measured else None,
            data_wait_frac_max=merged.data_wait_frac_max if measured else None,
            step_time_ms=perf["step_time_ms"],
            main_thread_busy_frac=perf["main_thread_busy_frac"],
            measured_steps=perf.get("measured_steps", 0),
            gpu_util_mean=util,
            gpu_util_mean_per_rank=merged.gpu_util_per_rank,
            gpu_mem_used_max_gb=resources.get("gpu_mem_used_max_gb"),
            gpu_mem_peak_gb=torch.cuda.max_memory_allocated(self.device) / 1e9 if cuda else None,
            cpu_pct_mean=resources.get("cpu_pct_mean"),
            proc_cpu_pct_mean=resources.get("proc_cpu_pct_mean"),
            rss_peak_gb=resources.get("rss_peak_gb"),
            pss_peak_gb=resources.get("pss_peak_gb"),
            pipeline=self.pipeline.summary(compute),
            tune=loader_args.get("tune"),
            validation={**val, "best_val_acc": progress.best_val_acc, "best_val_acc_ema": progress.best_val_acc_ema},
            steps=progress.step,
            skipped_samples=counts.skipped_samples,
            unreadable_files_count=len(counts.unreadable_files),
            unreadable_files=[{"path": path, "reason": reason} for path, reason in unreadable],
            nonfinite_steps=counts.nonfinite_steps,
            wall_time_s=wall_time_s,
            profile_trace=None,
            **self._setup(loader_args, precision),
        )
        return as_json(summary)

    def _throughput(self, perf: dict[str, Any], total: float | None, step: int) -> dict[str, Any]:
        """The summary's images_per_sec fields: the figure (all ranks) and this process's windows, their median
        and its interval, or why any of them is missing."""
        interval = perf["images_per_sec_interval"]
        return {
            "images_per_sec": total,
            "images_per_sec_note": None
            if total is not None
            else why_not_measured(step - self.start_step, self.warmup_steps, self.profiled_steps),
            "images_per_sec_per_process": perf["images_per_sec"],
            "images_per_sec_median": perf.get("images_per_sec_median"),
            "images_per_sec_windows": perf["windows"],
            "images_per_sec_interval": _scaled(interval, total, perf) if total is not None else None,
            "images_per_sec_interval_note": None
            if interval
            else too_few_windows(len(perf["windows"]), self.warmup_steps, self.log_every),
        }

    def _setup(self, loader_args: dict, precision: str) -> dict[str, Any]:
        """What the run ran with: the summary's fields from `loader` to `environment`."""
        device, info, settings = self.device, self.info, self.settings
        return {
            "loader": loader_args["train"],
            "loader_val": loader_args["val"],
            "batch_size_global": loader_args["train"]["batch_size"] * info.world_size,
            "world_size": info.world_size,
            "local_world_size": info.local_world_size,
            "device": str(device),
            "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
            "precision": precision,
            "compile_mode": settings.system.compile_mode.name if settings.system.compile else None,
            "dataset": settings.dataset.name,
            "dataset_root": getattr(settings.dataset, "root", None),
            "model": model_name(settings.model),
            "torch_version": torch.__version__,
            "torchvision_version": torchvision.__version__,
            "cpu_count": available_cpus(),
            "environment": self.environment,
        }

    def on_summary(self, summary: dict[str, Any], path: Path) -> None:
        """Add the verdict (on rank 0, from a sample of the files where decoding bounds the run); rank 0 writes
        metrics.json, the TensorBoard hparams and the console table."""
        summary["pipeline"]["input_stage"] = bounding_stage(summary)
        summary["pipeline"]["decode_sample"] = self._decode_sample(summary) if self.info.is_main else None
        summary["verdict"] = verdict(summary)
        if self.info.is_main:
            write_json(path, summary)
            self.tb.log_hparams(hparams(summary), hparam_metrics(summary))
            print_table(summary)
        self.tb.close()

    def _decode_sample(self, summary: dict[str, Any]) -> dict[str, Any] | None:
        """Where decoding bounds the run: a few dozen of its training files' decodes timed (data/decode_sample.py,
        a few seconds), with what `imgtrain-shards` would read them from; else None."""
        if self.train_set is None or not decode_bound(summary):
            return None
        log.info("decoding bounds this run: timing a few of its training JPEGs for the verdict (a few seconds)")
        try:
            sample = sample_decodes(self.train_set, self.settings.train.seed)
        except Exception as error:  # advice only: the run has finished, and its summary is written without it
            log.warning(
                "the decode sample failed (%s: %s); the verdict gives the general advice", type(error).__name__, error
            )
            return None
        if sample is not None:
            sample["source"] = _shards_source(self.settings.dataset)
        return sample


def _shards_source(dataset: Any) -> list[str] | None:
    """What `imgtrain-shards` reads this run's files from: the image folder, or the training CSV with `--val` and
    the validation CSV (dataset=csv); None when the config names neither."""
    train, val = getattr(dataset, "train", None), getattr(dataset, "val", None)
    if isinstance(train, str) and isinstance(val, str):
        return [train, "--val", val]
    root = getattr(dataset, "root", None)
    return [root] if isinstance(root, str) and root else None


def _scaled(interval: tuple[float, float] | None, total: float, perf: dict[str, Any]) -> list[float] | None:
    """This process's interval in the units of `images_per_sec` (summed over ranks)."""
    if interval is None or not perf["images_per_sec"]:
        return None
    ranks = total / perf["images_per_sec"]  # world size, or the ranks' share when they differ in speed
    return [round(interval[0] * ranks, 2), round(interval[1] * ranks, 2)]
