"""The `model` group's schemas (conf/model/): torchvision's and timm's models by name. A fork's own model needs no
schema: its conf/model/<name>.yaml names its builder by `_target_` (train/model.py)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from omegaconf import MISSING

from imgtrain.config.fields import checked


def _pretrained(value: Any) -> str | None:
    ok = isinstance(value, bool) or os.path.isfile(os.path.expanduser(str(value)))
    return None if ok else "expected true (the library's weights, from its cache), false, or a weights file's path"


@dataclass
class TorchvisionModelConfig:
    """Any classification model of torchvision.models, by name (model=torchvision model.arch=convnext_tiny)."""

    _target_: str = "imgtrain.train.model.build_torchvision"
    arch: str = "resnet18"  # a name torchvision.models.list_models(torchvision.models) gives
    cifar_stem: bool = False  # ResNets only: 3x3 stride-1 stem and no max-pool, for 32-px images
    zero_init_residual: bool = False  # ResNets only: each block's last BatchNorm starts at zero
    # true: torchvision's default weights from the torch hub cache (never downloaded here); or a weights file
    pretrained: Any = checked(False, _pretrained)

    @property
    def name(self) -> str:
        """What the log and metrics.json call the model."""
        return self.arch


@dataclass
class TimmModelConfig:
    """Any timm model, by name (model=timm model.name=convnext_atto): needs the extra imgtrain[timm]."""

    _target_: str = "imgtrain.train.model.build_timm"
    name: str = MISSING  # a name timm.list_models() gives, e.g. timm.list_models("*convnext*")
    pretrained: Any = checked(False, _pretrained)  # true: timm's weights from the Hugging Face cache; or a file
    drop_rate: float = checked(0.0, lambda v: None if 0.0 <= v < 1.0 else "expected a number in [0, 1)")
    drop_path_rate: float = checked(0.0, lambda v: None if 0.0 <= v < 1.0 else "expected a number in [0, 1)")


def model_name(model: Any) -> str:
    """What the log and metrics.json call the model: its `name`, else the builder its `_target_` names."""
    name = getattr(model, "name", None) if not isinstance(model, dict) else model.get("name")
    target = model.get("_target_", "") if isinstance(model, dict) else getattr(model, "_target_", "")
    return str(name) if name else str(target).rsplit(".", 1)[-1]
