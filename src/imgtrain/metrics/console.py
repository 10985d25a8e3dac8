"""What a run prints: the end-of-run table and the progress bar (the verdict it shows: metrics/report.py)."""

from __future__ import annotations

import logging
import statistics
import sys
from typing import Any

from tqdm import tqdm

from imgtrain.config.fields import AUTO
from imgtrain.config.val_metrics import VAL_METRICS, field


def epoch_start_line(summary: dict[str, Any]) -> str:
    """The console's epoch-start row: the first batch's wait and the stall after it."""
    first, costs = summary.get("epoch_first_batch_s") or [], summary.get("epoch_start_cost_s") or []
    if not first:
        return "n/a"
    text = f"first batch after {statistics.median(first):.3f} s (median of {len(first)} epoch(s))"
    if not costs:
        return f"{text}; one epoch: no later epoch start to measure"
    share = summary.get("epoch_start_cost_frac")
    of_epoch = f" ({share:.1%} of an epoch)" if share is not None else ""
    return f"{text}; each later start costs {statistics.median(costs):.3f} s{of_epoch}"


def rate_line(summary: dict[str, Any]) -> str:
    """`767.1 over all steady steps; median window 780.4 (95% interval of the median window 740.2-790.0, 12
    windows)`, or why there is no figure. Both figures: when windows vary (epoch-start stalls, a decode-bound
    stretch) the overall rate falls below the median window's interval, which belongs to the median alone."""
    if summary.get("images_per_sec_note"):
        return summary["images_per_sec_note"]
    rate, interval = _fmt(summary["images_per_sec"], ",.1f"), summary.get("images_per_sec_interval")
    if not interval:
        return f"{rate} ({summary.get('images_per_sec_interval_note') or 'no interval'})"
    windows = len(summary.get("images_per_sec_windows") or [])
    median, own = summary.get("images_per_sec_median"), summary.get("images_per_sec_per_process")
    # the median is this process's; the interval, like images_per_sec, is scaled to all ranks
    scaled = median * summary["images_per_sec"] / own if median and own else None
    return (
        f"{rate} over all steady steps; median window {_fmt(scaled, ',.1f')} (95% interval of the median window "
        f"{interval[0]:,.1f}-{interval[1]:,.1f}, {windows} windows)"
    )


def _fmt(value: Any, spec: str) -> str:
    return "n/a" if value is None else format(value, spec)


def print_table(summary: dict[str, Any]) -> None:
    """A short summary on the console."""
    loader = summary["loader"]
    rows = [
        ("images/s (steady state)", rate_line(summary)),
        ("data wait (share of step)", _fmt(summary["data_wait_frac"], ".1%")),
        ("epoch start", epoch_start_line(summary)),
        ("step time (ms)", _fmt(summary["step_time_ms"], ".1f")),
        ("verdict", summary.get("verdict") or "n/a"),
        ("input stages (ms per image)", stages_line(summary.get("pipeline"))),
        ("loading busy", busy_line(summary.get("pipeline"), loader.get("engine"))),
        ("GPU util (mean %)", _fmt(summary["gpu_util_mean"], ".1f")),
        ("CPU (mean % of system)", _fmt(summary["cpu_pct_mean"], ".1f")),
        ("RSS peak incl. workers (GB)", _fmt(summary["rss_peak_gb"], ".2f")),
        ("PSS peak incl. workers (GB)", _fmt(summary.get("pss_peak_gb"), ".2f")),
        *val_rows(summary),
        ("steps / wall time (s)", f"{summary['steps']} / {summary['wall_time_s']:.1f}"),
        (
            "loader",
            f"batch_size={loader['batch_size']} num_workers={loader['num_workers']} pin_memory={loader['pin_memory']}"
            + (" engine=threads" if loader.get("engine") == "threads" else ""),
        ),
        (
            "device / precision / world",
            f"{summary['device']} / {summary['precision']} / {summary['world_size']}",
        ),
    ]
    width = max(len(name) for name, _ in rows)
    lines = [f"  {name.ljust(width)}  {value}" for name, value in rows]
    print("\n".join(["", "Run summary", *lines, ""]), flush=True)


def val_rows(summary: dict[str, Any]) -> list[tuple[str, str]]:
    """A row per figure validation computes (config/val_metrics.py), the EMA's beside the model's when there is one."""
    rows = []
    for metric in VAL_METRICS:
        value, ema = _fmt(summary.get(field(metric)), ".4f"), summary.get(field(metric, ema=True))
        rows.append((metric.label, value if ema is None else f"{value} (EMA {ema:.4f})"))
    return rows


def stages_line(pipeline: dict[str, Any] | None) -> str:
    """`read 0.05  decode 0.40 ...`: each measured stage's milliseconds per image, workers' stages first."""
    per_image = (pipeline or {}).get("stage_ms_per_image") or {}
    shown = [f"{stage} {value:.3f}" for stage, value in per_image.items() if value is not None]
    return "  ".join(shown) if shown else "n/a (no timed batches: data.stage_timings=false or no DataLoader)"


def busy_line(pipeline: dict[str, Any] | None, engine: str | None = None) -> str:
    """How busy the loading processes (or threads, data.engine=threads) were: busy time over wall time x workers."""
    if not pipeline or pipeline.get("worker_busy_frac") is None:
        return "n/a"
    workers = pipeline["workers"]
    kind = "loader thread(s)" if engine == "threads" else "worker(s)"
    who = f"{workers} {kind}" if workers else "the training process (num_workers=0)"
    cpu = pipeline.get("loader_cpu_frac")
    on_cpu = f", on a CPU {cpu:.0%} of that time" if cpu is not None else ""  # threads: the rest waiting
    return f"{pipeline['worker_busy_frac']:.0%} of {who}, {pipeline['worker_busy_cores']:.2f} CPU cores{on_cpu}"


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
        logging.getLogger("imgtrain.train.run").info(
            "step %d: %s", global_step, " ".join(f"{k} {v}" for k, v in shown.items())
        )
    else:
        bar.set_postfix(shown, refresh=False)
