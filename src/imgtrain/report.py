"""End-of-run reporting: metrics.json, TensorBoard hparams, the console table, and the progress bar."""

from __future__ import annotations

import json
import logging
import os
import sys
from pathlib import Path
from typing import Any

import torch
import torchvision
from tqdm import tqdm

from imgtrain import dist
from imgtrain.config import AUTO, Config
from imgtrain.loader import auto_num_workers, available_cpus


def format_args(args: dict[str, Any]) -> str:
    """`key=value` pairs on one line, for the start-up log."""
    return " ".join(f"{k}={v}" for k, v in args.items())


def write_json(path: Path, payload: dict[str, Any]) -> None:
    """Write JSON atomically (temporary file, then rename), so a reader never sees half a file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(payload, indent=2, default=str) + "\n")
    os.replace(tmp, path)


def summarise(
    *,
    meter,
    monitor,
    progress,
    info: dist.DistInfo,
    device,
    precision,
    loader_args,
    settings: Config,
    wall_time_s: float,
) -> dict[str, Any]:
    """The run's final figures, reduced over ranks (a collective: every rank must call it)."""
    perf = meter.summary()
    resources = monitor.summary()
    rate, wait = perf["images_per_sec"], perf["data_wait_frac"]
    measured = rate is not None
    # Global throughput is the sum over ranks; data wait is the mean over ranks and, since the slowest rank
    # bounds a DDP step, also the max.
    rows = dist.all_gather_floats([rate or 0.0, wait or 0.0, resources.get("gpu_util_mean") or -1.0], device)
    summed = [sum(row[0] for row in rows), sum(row[1] for row in rows)]
    wait_max = max(row[1] for row in rows)
    gpu_utils = [row[2] for row in rows]
    val = progress.val
    return {
        "status": "ok",
        "mode": settings.mode,
        "images_per_sec": summed[0] if measured else None,
        "images_per_sec_per_process": rate,
        "images_per_sec_median": perf.get("images_per_sec_median"),
        "images_per_sec_windows": perf["windows"],
        "data_wait_frac": summed[1] / info.world_size if measured else None,
        "data_wait_frac_max": wait_max if measured else None,
        "step_time_ms": perf["step_time_ms"],
        "measured_steps": perf.get("measured_steps", 0),
        "gpu_util_mean": resources.get("gpu_util_mean"),
        "gpu_util_mean_per_rank": [u if u >= 0 else None for u in gpu_utils],
        "gpu_mem_used_max_gb": resources.get("gpu_mem_used_max_gb"),
        "gpu_mem_peak_gb": torch.cuda.max_memory_allocated(device) / 1e9 if device.type == "cuda" else None,
        "cpu_pct_mean": resources.get("cpu_pct_mean"),
        "proc_cpu_pct_mean": resources.get("proc_cpu_pct_mean"),
        "rss_peak_gb": resources.get("rss_peak_gb"),
        "val_acc": val.get("val_acc"),
        "val_loss": val.get("val_loss"),
        "val_count": val.get("val_count"),
        "best_val_acc": progress.best_val_acc,
        "steps": progress.step,
        "skipped_samples": progress.skipped_samples,
        "nonfinite_steps": progress.nonfinite_steps,
        "wall_time_s": wall_time_s,
        "loader": loader_args["train"],
        "loader_val": loader_args["val"],
        "batch_size_global": loader_args["train"]["batch_size"] * info.world_size,
        "world_size": info.world_size,
        "local_world_size": info.local_world_size,
        "device": str(device),
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "precision": precision,
        "dataset": settings.dataset.name,
        "model": settings.model.arch,
        "torch_version": torch.__version__,
        "torchvision_version": torchvision.__version__,
        "cpu_count": available_cpus(),
    }


def finish(summary: dict[str, Any], logger, path: Path, write: bool) -> None:
    """Add the verdict; rank 0 writes metrics.json, the TensorBoard hparams and the console table."""
    summary["verdict"] = verdict(summary)
    if write:
        write_json(path, summary)
        logger.log_hparams(hparams(summary), hparam_metrics(summary))
        print_table(summary)
    logger.close()


# Above this share of step time spent waiting for data, the run is called input-bound.
INPUT_BOUND_WAIT = 0.10


def suggest_next(summary: dict[str, Any]) -> str:
    """The next loader setting worth trying when a run is input-bound."""
    loader = summary["loader"]
    workers = loader["num_workers"]
    most = auto_num_workers(summary.get("local_world_size", summary["world_size"]), cpus=summary["cpu_count"])
    if workers < most:  # the same budget as num_workers=auto: this process's CPUs minus one for training
        return f"data.num_workers={min(max(1, 2 * workers), most)}"
    if summary["device"].startswith("cuda") and not loader["pin_memory"]:
        return "data.pin_memory=true"
    if workers and not loader.get("persistent_workers"):
        return "data.persistent_workers=true"
    if workers and (loader.get("prefetch_factor") or 2) < 4:
        return "data.prefetch_factor=4"
    return "fewer CPU cycles per image: pre-resized or smaller images, or decoding on the GPU"


def verdict(summary: dict[str, Any]) -> str:
    """Input-bound or compute-bound, from the share of step time spent waiting for data."""
    wait = summary["data_wait_frac"]
    if summary["mode"] != "train" or wait is None:
        return ""
    if wait > INPUT_BOUND_WAIT:
        return f"input-bound: {wait:.0%} of step time waits for data; try {suggest_next(summary)}"
    return f"compute-bound: only {wait:.0%} of step time waits for data; more loader workers will not help"


def hparams(summary: dict[str, Any]) -> dict[str, Any]:
    """Loader settings (and what else defines the run) for TensorBoard's HParams tab."""
    params = {f"data/{k}": v for k, v in summary["loader"].items()}
    params.update({key: summary[key] for key in ("dataset", "model", "precision", "device", "world_size")})
    return params


def hparam_metrics(summary: dict[str, Any]) -> dict[str, float | None]:
    """The final figures the HParams tab shows next to each run's settings."""
    keys = ("images_per_sec", "data_wait_frac", "gpu_util_mean", "val_acc", "rss_peak_gb")
    return {f"hparam/{k}": summary.get(k) for k in keys}


def _fmt(value: Any, spec: str) -> str:
    return "n/a" if value is None else format(value, spec)


def print_table(summary: dict[str, Any]) -> None:
    """A short summary on the console."""
    loader = summary["loader"]
    rows = [
        ("images/s (steady state)", _fmt(summary["images_per_sec"], ",.1f")),
        ("data wait (share of step)", _fmt(summary["data_wait_frac"], ".1%")),
        ("step time (ms)", _fmt(summary["step_time_ms"], ".1f")),
        ("verdict", summary.get("verdict") or "n/a"),
        ("GPU util (mean %)", _fmt(summary["gpu_util_mean"], ".1f")),
        ("CPU (mean % of system)", _fmt(summary["cpu_pct_mean"], ".1f")),
        ("RSS peak incl. workers (GB)", _fmt(summary["rss_peak_gb"], ".2f")),
        ("val acc (top-1)", _fmt(summary["val_acc"], ".4f")),
        ("steps / wall time (s)", f"{summary['steps']} / {summary['wall_time_s']:.1f}"),
        (
            "loader",
            f"batch_size={loader['batch_size']} num_workers={loader['num_workers']} pin_memory={loader['pin_memory']}",
        ),
        (
            "device / precision / world",
            f"{summary['device']} / {summary['precision']} / {summary['world_size']}",
        ),
    ]
    width = max(len(name) for name, _ in rows)
    lines = [f"  {name.ljust(width)}  {value}" for name, value in rows]
    print("\n".join(["", "Run summary", *lines, ""]), flush=True)


def progress_bar(total: int, epoch: int, setting: Any) -> tqdm:
    """A per-epoch bar with img/s; on by default only on a terminal, so logs in files stay readable."""
    show = sys.stderr.isatty() if setting == AUTO else bool(setting)
    return tqdm(total=total, desc=f"epoch {epoch + 1}", unit="step", disable=not show, dynamic_ncols=True, leave=False)


def update_progress(bar: tqdm, metrics: dict[str, float], global_step: int) -> None:
    """Show the latest window's figures on the bar (or as a log line when there is no bar)."""
    shown = {"loss": f"{metrics['train/loss']:.3f}"} if "train/loss" in metrics else {}
    if "perf/images_per_sec" in metrics:
        shown["img/s"] = f"{metrics['perf/images_per_sec']:.0f}"
        shown["wait"] = f"{metrics['perf/data_wait_frac']:.0%}"
    if bar.disable:
        logging.getLogger("imgtrain.run").info(
            "step %d: %s", global_step, " ".join(f"{k} {v}" for k, v in shown.items())
        )
    else:
        bar.set_postfix(shown, refresh=False)
