"""`metrics.json`: the typed definition of a run's final figures. docs/measurements.md's table of its fields lists
these fields in this order (tests/test_docs.py checks it). The validation fields are not spelled here: they follow
the list of what validation computes (config/val_metrics.py), in `validation`'s place."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, fields
from typing import Any

from imgtrain.config.val_metrics import summary_fields


@dataclass
class RunSummary:
    """A train, loader or compute run's final figures, reduced over ranks; rank 0 writes it as metrics.json."""

    status: str  # "ok" (a failed run writes failed.json instead)
    mode: str  # train, loader or compute
    images_per_sec: float | None  # steady state, summed over ranks; None when too few steps were measured
    images_per_sec_note: str | None  # why images_per_sec is None
    images_per_sec_per_process: float | None
    images_per_sec_median: float | None  # the median window's, this process
    images_per_sec_windows: list[float]  # each steady window's, this process
    # 95% interval of the median window's images/s (metrics/spread.py), scaled to all ranks like images_per_sec
    images_per_sec_interval: list[float] | None
    images_per_sec_interval_note: str | None  # why there is no interval: too few windows, and the steps enough
    data_wait_frac: float | None  # share of step time waiting for a batch, mean over ranks
    # The epoch-start stall (metrics/epoch_start.py), this process: seconds from each epoch's start to its first
    # batch; each later epoch's first window beyond its steps at the steady step time; the median of that as a
    # share of an epoch
    epoch_first_batch_s: list[float]
    epoch_start_cost_s: list[float]
    epoch_start_cost_frac: float | None
    data_wait_frac_max: float | None  # the slowest rank's
    step_time_ms: float | None
    # the training thread's CPU seconds over the steady state's wall seconds, this process: near 1 with the GPU idle,
    # the step is bound by the host's kernel launches (metrics/host_bound.py)
    main_thread_busy_frac: float | None
    measured_steps: int  # steps in the steady state (after metrics.skip_first_steps)
    gpu_util_mean: float | None  # NVML, %
    gpu_util_mean_per_rank: list[float | None]
    gpu_mem_used_max_gb: float | None  # NVML, device-wide
    gpu_mem_peak_gb: float | None  # torch.cuda.max_memory_allocated
    cpu_pct_mean: float | None  # the system's
    proc_cpu_pct_mean: float | None  # this process and its workers, % of all CPUs
    rss_peak_gb: float | None  # this process and its workers
    pss_peak_gb: float | None  # shared pages counted once; None without PSS (non-Linux)
    pipeline: dict[str, Any]  # the input stages: ms per image, loading busy, the ceilings, input_stage
    tune: dict[str, Any] | None  # data.num_workers=tune: the probe's measurements and choice
    # val_acc, val_acc5, val_loss, their _ema twins (null without train.ema_decay), val_count, best_val_acc,
    # best_val_acc_ema: config/val_metrics.py's `summary_fields()`, each null until validated; flat in metrics.json
    validation: dict[str, float | None]
    steps: int
    skipped_samples: int  # unreadable reads: a file read in 3 epochs counts 3 times
    unreadable_files_count: int  # distinct files
    unreadable_files: list[dict[str, str]]  # the first UNREADABLE_LISTED: path and reason
    nonfinite_steps: int
    wall_time_s: float
    profile_trace: str | None  # metrics.profile=true: rank 0's trace
    loader: dict[str, Any]  # the effective training DataLoader arguments
    loader_val: dict[str, Any]
    batch_size_global: int
    world_size: int
    local_world_size: int
    device: str
    device_name: str
    precision: str
    compile_mode: str | None  # system.compile_mode's name with system.compile=true; None: eager
    dataset: str
    dataset_root: str | None  # what a read-bound verdict names
    model: str
    torch_version: str
    torchvision_version: str
    cpu_count: int  # CPUs available to this process
    environment: dict[str, Any] | None  # the pre-flight fingerprint (preflight.py)
    verdict: str | None = None  # what bounds the run (metrics/report.py), added at the end


def as_json(summary: RunSummary) -> dict[str, Any]:
    """metrics.json's content: `summary`'s fields in order, `validation`'s spliced in flat at its place."""
    flat: dict[str, Any] = {}
    for name, value in dataclasses.asdict(summary).items():
        flat.update({key: value.get(key) for key in summary_fields()} if name == "validation" else {name: value})
    return flat


FIELDS = tuple(
    name for spec in fields(RunSummary) for name in (summary_fields() if spec.name == "validation" else (spec.name,))
)
