"""Step timing: throughput and the share of step time spent waiting for data, measured without per-step syncs.

The loop calls `add_step` every step with host-side timings (no GPU sync). Windows are closed only right
after the loop has synced anyway (when it reads the loss every `log_every_n_steps`), so each window's wall
time is exact even though individual CUDA steps are asynchronous. Each window also keeps the CPU seconds the training
thread itself ran (`time.thread_time`, one read per window): a GPU run whose thread runs nearly all the time while the
GPU idles is bound by its kernel launches (metrics/host_bound.py).
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field

from imgtrain.metrics.spread import median_interval


@dataclass
class Window:
    """One measured stretch of consecutive training steps."""

    steps: int
    images: int
    seconds: float
    wait_seconds: float
    cpu_seconds: float = 0.0  # the training thread's CPU time (time.thread_time) in the window

    @property
    def images_per_sec(self) -> float:
        return self.images / self.seconds if self.seconds > 0 else 0.0

    @property
    def data_wait_frac(self) -> float:
        return min(1.0, self.wait_seconds / self.seconds) if self.seconds > 0 else 0.0

    @property
    def step_time_ms(self) -> float:
        return 1000.0 * self.seconds / self.steps if self.steps else 0.0


@dataclass
class StepMeter:
    """Accumulates steps into windows; only windows that start after `warmup_steps` count as steady state."""

    warmup_steps: int
    windows: list[Window] = field(default_factory=list)
    _start: float | None = None
    _steps: int = 0
    _images: int = 0
    _wait: float = 0.0
    _cpu_start: float = 0.0
    _seen_steps: int = 0

    def start_window(self) -> None:
        """Begin a window now (call right after a sync point, or at the start of an epoch)."""
        self._start, self._steps, self._images, self._wait = time.perf_counter(), 0, 0, 0.0
        self._cpu_start = time.thread_time()  # the loop's thread: this is called where the loop runs

    def add_step(self, images: int, wait_seconds: float) -> None:
        """Record one step: the images it trained on and the seconds it blocked on the DataLoader."""
        self._seen_steps += 1
        self._steps += 1
        self._images += images
        self._wait += wait_seconds

    @property
    def open_steps(self) -> int:
        """Steps recorded since the window started."""
        return self._steps if self._start is not None else 0

    def close_window(self) -> Window | None:
        """End the current window (the caller has just synced); return it, and keep it if it is steady."""
        if self._start is None or self._steps == 0:
            return None
        cpu = time.thread_time() - self._cpu_start
        window = Window(self._steps, self._images, time.perf_counter() - self._start, self._wait, cpu)
        self._start = None
        if self._seen_steps - self._steps >= self.warmup_steps:  # the window began after warm-up
            self.windows.append(window)
        return window

    def steady_step_s(self) -> float | None:
        """The median steady window's seconds per step (None before the first steady window)."""
        return statistics.median(w.seconds / w.steps for w in self.windows) if self.windows else None

    def summary(self) -> dict[str, float | None | list[float]]:
        """Steady-state figures over every kept window; None when the run was too short to have any."""
        if not self.windows:
            return {
                "images_per_sec": None,
                "data_wait_frac": None,
                "step_time_ms": None,
                "windows": [],
                "images_per_sec_interval": None,
                "main_thread_busy_frac": None,
            }
        seconds = sum(w.seconds for w in self.windows)
        rates = [w.images_per_sec for w in self.windows]
        return {
            "images_per_sec": sum(w.images for w in self.windows) / seconds,
            "data_wait_frac": min(1.0, sum(w.wait_seconds for w in self.windows) / seconds),
            "step_time_ms": 1000.0 * seconds / sum(w.steps for w in self.windows),
            "images_per_sec_median": statistics.median(rates),
            "images_per_sec_interval": median_interval(rates),  # of the median; None with too few windows
            "measured_steps": sum(w.steps for w in self.windows),
            "measured_seconds": seconds,
            "main_thread_busy_frac": sum(w.cpu_seconds for w in self.windows) / seconds,
            "windows": [round(r, 2) for r in rates],
        }
