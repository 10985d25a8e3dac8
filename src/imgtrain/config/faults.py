"""The `faults` group's schema (conf/faults/): what a run does when something goes wrong while training."""

from __future__ import annotations

from dataclasses import dataclass

from imgtrain.config.fields import SECONDS, Choice, checked


class NonFinite(Choice):
    stop = "stop"  # keep the last good checkpoint and stop
    skip = "skip"  # skip the update (counted); reads the loss every step


@dataclass
class FaultsConfig:
    """What a run does when something goes wrong while training. faults.<key>=... (The DataLoader's own limits,
    data.max_bad_samples and data.timeout, are data keys.)"""

    nonfinite: NonFinite = NonFinite.stop  # a NaN/inf loss: stop, or skip the step (counted)
    dist_timeout_s: float = checked(600.0, lambda v: None if v > 0 else SECONDS)  # a collective waits this long
