"""What a person reads: the verdict on what bounds a run, the end-of-run table, and the progress bar."""

from __future__ import annotations

import logging
import sys
from typing import Any

from tqdm import tqdm

from imgtrain.config import AUTO
from imgtrain.data.loader import auto_num_workers

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


def why_not_measured(steps_run: int, warmup_steps: int) -> str:
    """Why a run has no throughput figure, and how to get one."""
    if steps_run <= warmup_steps:
        return (
            f"not measured: all {steps_run} steps of this run were warm-up steps (trainer.warmup_steps="
            f"{warmup_steps}), which throughput leaves out; run more steps (trainer.max_steps) or lower "
            "trainer.warmup_steps"
        )
    return f"not measured: no steady-state window closed in this run's {steps_run} steps"


def _fmt(value: Any, spec: str) -> str:
    return "n/a" if value is None else format(value, spec)


def print_table(summary: dict[str, Any]) -> None:
    """A short summary on the console."""
    loader = summary["loader"]
    rows = [
        ("images/s (steady state)", summary.get("images_per_sec_note") or _fmt(summary["images_per_sec"], ",.1f")),
        ("data wait (share of step)", _fmt(summary["data_wait_frac"], ".1%")),
        ("step time (ms)", _fmt(summary["step_time_ms"], ".1f")),
        ("verdict", summary.get("verdict") or "n/a"),
        ("GPU util (mean %)", _fmt(summary["gpu_util_mean"], ".1f")),
        ("CPU (mean % of system)", _fmt(summary["cpu_pct_mean"], ".1f")),
        ("RSS peak incl. workers (GB)", _fmt(summary["rss_peak_gb"], ".2f")),
        ("PSS peak incl. workers (GB)", _fmt(summary.get("pss_peak_gb"), ".2f")),
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
