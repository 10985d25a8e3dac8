"""The epoch-start stall (pytorch/pytorch#19836): what each epoch's start costs the training loop.

Two figures per epoch, both on the host clock, with no sync of their own:
- `first_batch_s`: seconds from the epoch's start (`Metrics.on_epoch_start`) to its first batch in hand. It holds
  starting the DataLoader's workers (or resuming persistent ones) and making the first batch.
- `cost_s`: the epoch's first logging window (it opens at the epoch's start) minus its steps at the steady
  step time (the median over steady windows). It adds the steps that run slowly after the boundary, such as
  those that re-fault memory released by validation.

Validation and checkpoint saves happen between `on_epoch_end` and the next `on_epoch_start`, outside every window,
so neither figure counts them. This process's first epoch is left out of the cost: its start is the run's
start-up, which `metrics.skip_first_steps` already keeps out of throughput.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field

from imgtrain.metrics.windows import Window


@dataclass
class EpochStarts:
    first_batch_s: list[float] = field(default_factory=list)
    first_windows: list[tuple[int, float]] = field(default_factory=list)  # (steps, seconds) per epoch
    _started: float | None = None
    _awaiting_batch: bool = False
    _awaiting_window: bool = False

    def begin(self) -> None:
        self._started, self._awaiting_batch, self._awaiting_window = time.perf_counter(), True, True

    def batch_arrived(self) -> float | None:
        """At each batch: the epoch's first one records, and returns, the seconds since the epoch started."""
        if not self._awaiting_batch or self._started is None:
            return None
        self._awaiting_batch = False
        self.first_batch_s.append(time.perf_counter() - self._started)
        return self.first_batch_s[-1]

    def window_closed(self, window: Window | None) -> bool:
        """At each window's end: whether it was the epoch's first (then it is recorded)."""
        if not self._awaiting_window or window is None:
            return False
        self._awaiting_window = False
        self.first_windows.append((window.steps, window.seconds))
        return True

    def cost(self, steps: int, seconds: float, step_s: float | None) -> float | None:
        """A first window's seconds beyond its steps at the steady step time."""
        return None if step_s is None else max(0.0, seconds - steps * step_s)

    def summary(self, step_s: float | None, steps_per_epoch: int) -> dict[str, float | list[float] | None]:
        """Per-epoch figures, and the median cost as a share of an epoch at the steady step time."""
        costs = [self.cost(steps, seconds, step_s) for steps, seconds in self.first_windows[1:]]
        costs = [round(c, 4) for c in costs if c is not None]
        share = None
        if costs and step_s and steps_per_epoch:
            share = statistics.median(costs) / (steps_per_epoch * step_s)
        return {
            "epoch_first_batch_s": [round(s, 4) for s in self.first_batch_s],
            "epoch_start_cost_s": costs,
            "epoch_start_cost_frac": share,
        }
