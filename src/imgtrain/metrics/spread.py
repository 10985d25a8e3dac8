"""How sure a throughput figure is: a 95% interval for the median of a run's steady-state window rates, and the
rule that says whether two runs differ.

The statistic. A run's throughput is measured in logging windows (`metrics.log_every_n_steps` steps each, about
1-2 s). Their rates are not normal: a window that holds an epoch start, a garbage collection or a neighbour's
burst is far slower than the rest. So the figure a decision uses is the **median** window rate, and its interval
is the distribution-free one from order statistics (the sign-test interval: the median lies between the k-th
smallest and the k-th largest of n values with the binomial probability computed below; no assumption about the
shape). It needs at least `MIN_WINDOWS` windows for 95%. Window rates are positively autocorrelated (a slow
minute slows neighbouring windows) and the interval assumes independent windows, so it is, if anything, too
narrow; the tie rule below therefore asks for clear separation, not for a significance test.

Two runs differ only when their intervals do not overlap. Otherwise they are tied within noise.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

CONFIDENCE = 0.95
MIN_WINDOWS = 6  # the fewest windows whose extremes bound the median with >= 95%: 1 - 2 x 0.5**6 = 96.9%


def median_interval(values: Sequence[float], confidence: float = CONFIDENCE) -> tuple[float, float] | None:
    """(low, high): order statistics that bound the median of the values' distribution with at least
    `confidence`, as narrow as that allows; None with fewer than `MIN_WINDOWS` values."""
    n = len(values)
    if n < MIN_WINDOWS:
        return None
    ordered = sorted(values)
    # P(X_(k) <= median <= X_(n-k+1)) = 1 - 2 P(Binomial(n, 1/2) <= k - 1); take the largest k that keeps it
    k = 1
    while k + 1 <= n // 2 and 1 - 2 * _binomial_cdf(k, n) >= confidence:
        k += 1
    return ordered[k - 1], ordered[n - k]


def _binomial_cdf(k: int, n: int) -> float:
    """P(Binomial(n, 1/2) <= k)."""
    return sum(math.comb(n, i) for i in range(k + 1)) / 2**n


def windows_needed(skip_first_steps: int, log_every_n_steps: int) -> int:
    """The train.max_steps that gives `MIN_WINDOWS` steady-state windows (the first window after the skipped
    steps may be partial, hence one more)."""
    return skip_first_steps + (MIN_WINDOWS + 1) * log_every_n_steps


def overlaps(a: tuple[float, float], b: tuple[float, float]) -> bool:
    """Whether two intervals share any value: the runs are not told apart by these measurements."""
    return a[0] <= b[1] and b[0] <= a[1]


@dataclass(frozen=True)
class Rate:
    """A rate measured as repeated samples (steps, windows, probe rounds): their median and its 95% interval
    (None with fewer than `MIN_WINDOWS` samples)."""

    median: float
    interval: tuple[float, float] | None
    samples: int

    @classmethod
    def of(cls, samples: Sequence[float]) -> Rate:
        return cls(statistics.median(samples) if samples else 0.0, median_interval(samples), len(samples))

    def text(self, unit: str = "images/s", of: str = "samples") -> str:
        """`140.8 images/s (95% interval 130.1-150.2, 31 steps)`."""
        if self.interval is None:
            return f"{self.median:.1f} {unit} (median of {self.samples} {of}: too few for an interval)"
        low, high = self.interval
        return f"{self.median:.1f} {unit} (95% interval {low:.1f}-{high:.1f}, {self.samples} {of})"

    @classmethod
    def read(cls, record: dict[str, Any], name: str, samples: int = 0) -> Rate | None:
        """The rate `fields` wrote into `record` under `name`; None when it holds none."""
        median, interval = record.get(name), record.get(f"{name}_interval")
        return cls(median, (interval[0], interval[1]) if interval else None, samples) if median else None

    def fields(self, name: str) -> dict[str, Any]:
        """`{name: median, name_interval: [low, high] or None}` for metrics.json and loader_args.json."""
        return {name: self.median, f"{name}_interval": list(self.interval) if self.interval else None}


def indistinguishable(a: Rate, b: Rate) -> bool:
    """Whether two rates are told apart by neither: their intervals overlap. False when either has no interval
    (unknown): the caller says so."""
    return a.interval is not None and b.interval is not None and overlaps(a.interval, b.interval)
