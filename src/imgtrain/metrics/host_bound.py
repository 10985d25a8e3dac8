"""The host-bound verdict: a GPU run that neither waits for data nor keeps its GPU busy, while the training thread
runs nearly all the time, is bound by the host launching the step's kernels one by one from Python.

On one H200 (2026-11-27) the ResNet-18 DataLoader row waited 0.85 ms a step for data (under 10% of it) while the GPU
was 43% busy and the training thread spent its step in forward and backward launches; 15 workers shared the 16 cores
with it. CUDA graphs (system.compile_mode=reduce_overhead) ran the same model 1.8x as fast as its eager ceiling: one
launch per step instead of hundreds. Fewer workers give the launching thread its core back.
"""

from __future__ import annotations

import math
from typing import Any

# The training thread ran at least this share of the steady state's wall time (time.thread_time over wall seconds)
MAIN_THREAD_BUSY = 0.85
# NVML's share of time a kernel ran, mean %, below which the GPU is called idle for a step that waits for no data:
# the eager ResNet-18 ceiling, launch-bound itself, ran at 76% (H200, 2026-11-27); a compute-bound step is at 95-100%
GPU_IDLE_PCT = 80.0
# Workers prescribed: what they kept busy (cores), with this headroom, rounded up
WORKER_HEADROOM = 1.25


def host_bound(summary: dict[str, Any], wait: float) -> str | None:
    """The verdict for a launch-bound GPU run, with the figures that show it; None when the run is not one (no GPU
    figure, a busy GPU, or a training thread that is not busy)."""
    util, busy = summary.get("gpu_util_mean"), summary.get("main_thread_busy_frac")
    if util is None or busy is None or util >= GPU_IDLE_PCT or busy < MAIN_THREAD_BUSY:
        return None
    remedies = [compile_remedy(summary.get("compile_mode"))]
    fewer = fewer_workers(summary)
    if fewer:
        remedies.append(fewer)
    return (
        f"host-bound: only {wait:.0%} of step time waits for data and the GPU is busy {util:.0f}% of the time (NVML), "
        f"while the training thread runs {busy:.0%} of it: launching the step's kernels from Python bounds the run; "
        f"try {'; and '.join(remedies)}"
    )


def compile_remedy(compile_mode: str | None) -> str:
    """What cuts the launches, from what this run already did (`compile_mode`: system.compile_mode's name, None
    when not compiled)."""
    if compile_mode is None:
        return (
            "system.compile=true system.compile_mode=reduce_overhead (fused kernels, launched as one CUDA graph per "
            "step)"
        )
    if compile_mode in ("default", "max_autotune_no_cudagraphs"):
        return "system.compile_mode=reduce_overhead (CUDA graphs: one launch per step)"
    return "a larger data.batch_size (the same launches for more images; CUDA graphs are already on)"


def fewer_workers(summary: dict[str, Any]) -> str | None:
    """`data.num_workers=N` where the workers kept fewer cores busy than they hold: enough for the cores they used,
    with WORKER_HEADROOM; None when that is not fewer."""
    pipeline, loader = summary.get("pipeline") or {}, summary.get("loader") or {}
    workers, cores = loader.get("num_workers") or 0, pipeline.get("worker_busy_cores")
    if not workers or cores is None:
        return None
    enough = max(1, math.ceil(cores * WORKER_HEADROOM))
    if enough >= workers:
        return None
    return (
        f"data.num_workers={enough} (the {workers} workers kept {cores:.1f} cores busy; the rest of their cores go to "
        "the launching thread)"
    )
