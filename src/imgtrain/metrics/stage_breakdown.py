"""The input pipeline's stage breakdown, per logging window and over the run's steady state.

Fed one batch at a time by the loop's batch iterator (`add`): its data wait, the transfer part of that wait and
the `BatchTimes` the workers stamped on it. Windows close where `StepMeter`'s do (right after a sync), so the
CUDA events of the copy and GPU-decode timers are complete there.
"""

from __future__ import annotations

from typing import Any

from imgtrain.data.stages import STAGES, BatchTimes, StreamTimer
from imgtrain.host import dist
from imgtrain.metrics.spread import Rate

# Accumulated per window and over the steady state: seconds, except the counts.
FIELDS = ("wait", "transfer", "read", "decode", "augment", "collate", "busy", "samples", "batches")
FIELDS += ("timed_batches", "h2d", "copies", "gpu_decode", "decodes", "seconds", "cpu")
COMPUTE_FIELDS = ("compute_images_per_sec", "compute_images_per_sec_interval")  # the model alone: median, interval


class PipelineMeter:
    """Stage seconds per window (TensorBoard `pipeline/...`) and over the steady state (metrics.json)."""

    def __init__(
        self, workers: int, copy_timer: StreamTimer | None = None, decode_timer: StreamTimer | None = None
    ) -> None:
        self.workers, self.copy_timer, self.decode_timer = workers, copy_timer, decode_timer
        self.window = dict.fromkeys(FIELDS, 0.0)
        self.steady = dict.fromkeys(FIELDS, 0.0)

    def add(self, wait: float, transfer: float, times: BatchTimes | tuple) -> None:
        """One batch the loop received: it waited `wait` s, `transfer` s of it after the batch was finished."""
        window = self.window
        window["wait"] += wait
        window["transfer"] += transfer
        window["batches"] += 1
        if times:
            window["timed_batches"] += 1
            for key in ("read", "decode", "augment", "collate", "busy", "samples", "cpu"):
                window[key] += getattr(times, key)

    def discard_copies(self) -> None:
        """Forget copy and decode timings not from training (validation's batches), at the start of an epoch."""
        for timer in (self.copy_timer, self.decode_timer):
            if timer is not None:
                timer.collect()

    def close_window(self, seconds: float, steady: bool) -> dict[str, float]:
        """The window's `pipeline/...` TensorBoard values; a steady window also counts toward the summary."""
        window, self.window = self.window, dict.fromkeys(FIELDS, 0.0)
        window["seconds"] = seconds
        copies = self.copy_timer.collect() if self.copy_timer is not None else None
        if copies is not None:
            window["h2d"], window["copies"] = copies
        decodes = self.decode_timer.collect() if self.decode_timer is not None else None
        if decodes is not None:
            window["gpu_decode"], window["decodes"] = decodes
        if steady:
            for key, value in window.items():
                self.steady[key] += value
        return window_values(window, self.workers, measured_copy=copies is not None)

    def summary(self, compute: Rate | None = None) -> dict[str, Any]:
        """The steady state's breakdown for metrics.json, summed over ranks (one exchange; every rank calls it),
        with the model's own rate (this process's) and its interval when `compute` measured it."""
        rows = dist.all_gather_host([self.steady[key] for key in FIELDS])
        totals = {key: sum(row[i] for row in rows) for i, key in enumerate(FIELDS)}
        own = compute.fields("compute_images_per_sec") if compute else dict.fromkeys(COMPUTE_FIELDS)
        return breakdown(totals, self.workers, self.copy_timer is not None and self.copy_timer.enabled) | own


def _per(value: float, count: float, scale: float = 1000.0) -> float | None:
    return scale * value / count if count else None


def window_values(window: dict[str, float], workers: int, measured_copy: bool) -> dict[str, float]:
    """TensorBoard scalars with units: ms per image for the per-sample stages, ms per batch for the rest."""
    values: dict[str, float | None] = {}
    if window["timed_batches"]:
        for stage in ("read", "decode", "augment"):
            values[f"pipeline/{stage}_ms_per_image"] = _per(window[stage], window["samples"])
        values["pipeline/collate_ms_per_batch"] = _per(window["collate"], window["timed_batches"])
        values["pipeline/transfer_ms_per_batch"] = _per(window["transfer"], window["batches"])
        values["pipeline/worker_busy_frac"] = _per(window["busy"], window["seconds"] * max(1, workers), 1.0)
        if window["wait"]:
            values["pipeline/transfer_frac_of_wait"] = min(1.0, window["transfer"] / window["wait"])
    if measured_copy and window["copies"]:
        values["pipeline/h2d_ms_per_batch"] = _per(window["h2d"], window["copies"])
    if window["decodes"]:  # dataset.decode=cuda: the decode stream's wall time per batch (CUDA events; stages.py)
        values["pipeline/gpu_decode_ms_per_batch"] = _per(window["gpu_decode"], window["decodes"])
    return {key: value for key, value in values.items() if value is not None}


def breakdown(totals: dict[str, float], workers: int, measured_copy: bool) -> dict[str, Any]:
    """Per-image milliseconds of every stage (null where not measured), and how busy the workers were."""
    timed = bool(totals["timed_batches"])
    per_image = {stage: None for stage in STAGES}
    if timed:
        images_per_batch = totals["samples"] / totals["timed_batches"]
        for stage in ("read", "decode", "augment", "collate"):
            per_image[stage] = _per(totals[stage], totals["samples"])
        per_image["transfer"] = _per(totals["transfer"], totals["batches"] * images_per_batch)
        if totals["decodes"]:
            per_image["gpu_decode"] = _per(totals["gpu_decode"], totals["decodes"] * images_per_batch)
        if measured_copy and totals["copies"]:
            per_image["h2d"] = _per(totals["h2d"], totals["copies"] * images_per_batch)
    return {
        "stage_ms_per_image": per_image,
        "worker_busy_frac": _per(totals["busy"], totals["seconds"] * max(1, workers), 1.0) if timed else None,
        "worker_busy_cores": _per(totals["busy"], totals["seconds"], 1.0) if timed else None,
        # loader threads: CPU seconds over busy seconds (the rest waiting for the GIL, a core or a read)
        "loader_cpu_frac": _per(totals["cpu"], totals["busy"], 1.0) if totals["cpu"] else None,
        "transfer_frac_of_wait": min(1.0, totals["transfer"] / totals["wait"]) if totals["wait"] else None,
        "workers": workers,
        "timed_batches": int(totals["timed_batches"]),
    }
