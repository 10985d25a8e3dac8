"""The `schedule` group's schemas (conf/schedule/): any LR-schedule builder by `_target_`
(train/schedules.py)."""

from __future__ import annotations

from dataclasses import dataclass

from imgtrain.config.fields import at_least, checked


@dataclass
class WarmupCosineConfig:
    """Linear warm-up, then a cosine to zero at the last step."""

    _target_: str = "imgtrain.train.schedules.warmup_cosine"  # (optimizer, steps_per_epoch, total_steps, ...)
    warmup_epochs: float = checked(0.5, at_least(0, "a number"))  # linear from lr / warm-up steps to lr; 0 = none


@dataclass
class StepDecayConfig:
    """Linear warm-up, then the LR times `gamma` every `step_epochs` epochs (torchvision's StepLR recipe)."""

    _target_: str = "imgtrain.train.schedules.warmup_step"  # (optimizer, steps_per_epoch, total_steps, ...)
    warmup_epochs: float = checked(0.0, at_least(0, "a number"))  # linear from lr / warm-up steps to lr; 0 = none
    step_epochs: float = checked(30.0, lambda v: None if v > 0 else "expected epochs > 0")  # counted after warm-up
    gamma: float = checked(0.1, lambda v: None if 0.0 < v <= 1.0 else "expected a factor in (0, 1]")  # per drop
