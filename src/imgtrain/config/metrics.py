"""The `metrics` group's schema (conf/metrics/): what is measured and logged, and how often."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from imgtrain.config.fields import AUTO, SECONDS, at_least, auto_or_bool, checked


@dataclass
class MetricsConfig:
    """What is measured and logged, and how often. metrics.<key>=..."""

    # steps left out of throughput and data-wait figures: start-up (allocations, cuDNN autotuning), first batches
    skip_first_steps: int = checked(10, at_least(0))
    log_every_n_steps: int = checked(20, at_least(1))  # when the loop reads the loss back and logs
    progress_bar: Any = checked(AUTO, auto_or_bool)  # auto: only on a terminal
    monitor_interval_s: float = checked(0.5, lambda v: None if v > 0 else SECONDS)  # NVML/CPU/RSS samples
    # After training, time the model alone (a copy, on a batch already on the device) to tell CPU contention
    # from compute-bound. auto: only when workers and training may compete for the CPUs
    compute_probe: Any = checked(AUTO, auto_or_bool)
    # A torch.profiler trace of profile_steps steps after skip_first_steps (+1 profiler warm-up step), rank 0
    # only: <run dir>/profile/trace_rank0.json.gz for https://ui.perfetto.dev, and the top operators as text.
    profile: bool = False
    profile_steps: int = checked(5, at_least(1, note="steps recorded"))
