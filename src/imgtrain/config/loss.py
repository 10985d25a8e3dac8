"""The `loss` group's schemas (conf/loss/): any loss module by `_target_`, (logits, targets) -> the mean loss."""

from __future__ import annotations

from dataclasses import dataclass

from imgtrain.config.fields import at_least, checked

_SMOOTHING = "expected a number in [0, 1)"


@dataclass
class CrossEntropyConfig:
    """torch.nn.CrossEntropyLoss: hard labels, or the soft ones mixup/cutmix make."""

    _target_: str = "torch.nn.CrossEntropyLoss"  # a loss module's class: (logits, targets) -> the mean loss
    # the share of each target moved to the uniform distribution, in [0, 1); torchvision's recipes use 0.1
    label_smoothing: float = checked(0.0, lambda v: None if 0.0 <= v < 1.0 else _SMOOTHING)


@dataclass
class FocalLossConfig:
    """Focal loss (Lin et al., 2017) on the softmax: cross-entropy weighted by (1 - p)^gamma per example."""

    _target_: str = "imgtrain.train.losses.FocalLoss"  # a loss module's class: (logits, targets) -> the mean loss
    gamma: float = checked(2.0, at_least(0, "a number"))  # the focusing exponent; 0 = cross-entropy
    # the share of each target moved to the uniform distribution, in [0, 1)
    label_smoothing: float = checked(0.0, lambda v: None if 0.0 <= v < 1.0 else _SMOOTHING)
