"""The models: any of torchvision's or timm's by name, each builder checking its name and options first. A fork's
own model is a builder beside these (or a module of its own) that conf/model/<name>.yaml names by `_target_`;
where and how it runs (precision, DDP, compile) is train/placement.py's."""

from __future__ import annotations

import difflib
import re
from types import ModuleType
from typing import Any

import torchvision
from torch import nn

from imgtrain.common.errors import ConfigError, first_line
from imgtrain.host import optional
from imgtrain.train.pretrained import load_matching, read_weights, timm_weights, torchvision_weights

# How to list the names each builder takes, for the line that rejects one.
TORCHVISION_NAMES = 'python -c "import torchvision; print(torchvision.models.list_models(torchvision.models))"'
TIMM_NAMES = "python -c \"import timm; print(timm.list_models('*{}*'))\""
# Their training forward returns (logits, auxiliary logits) unless aux_logits=False; the loop takes logits. Their
# ImageNet weights expect transform_input=True, which torchvision sets when it loads them.
AUXILIARY_HEADS = ("googlenet", "inception_v3")
RESNET_ONLY = ("cifar_stem", "zero_init_residual")


def close_names(name: str, names: list[str]) -> str:
    """' (close: a, b)' for the names like `name`, else ''."""
    close = difflib.get_close_matches(name, names, n=3)
    return f" (close: {', '.join(close)})" if close else ""


def check_torchvision(arch: str, cifar_stem: bool = False, zero_init_residual: bool = False) -> None:
    """An arch torchvision.models does not classify with, or a ResNet-only option on another: one line."""
    names = torchvision.models.list_models(torchvision.models)  # classification only: not detection's, video's
    if arch not in names:
        raise ConfigError(
            f"model.arch={arch} is not a classification model of torchvision.models{close_names(arch, names)}: "
            f"list them with {TORCHVISION_NAMES}, or use model=timm model.name=..."
        )
    resnet = torchvision.models.get_model_builder(arch).__module__ == torchvision.models.resnet.__name__
    asked = [key for key, on in zip(RESNET_ONLY, (cifar_stem, zero_init_residual), strict=True) if on]
    if asked and not resnet:
        raise ConfigError(
            f"model.{asked[0]}=true is for torchvision's ResNets (resnet*, resnext*, wide_resnet*), and "
            f"model.arch={arch} is not one: set model.{asked[0]}=false"
        )


def build_torchvision(
    arch: str = "resnet18",
    num_classes: int = 10,
    cifar_stem: bool = False,
    zero_init_residual: bool = False,
    pretrained: bool | str = False,
) -> nn.Module:
    """Any classification model of torchvision.models; for ResNets, optionally the CIFAR stem (3x3 stride-1 conv,
    no max-pool) for 32-px input and zero-init residuals. `pretrained`: true, torchvision's default weights from the
    torch hub cache (never downloaded); a path, that file's weights. The head stays at init for other classes."""
    check_torchvision(arch, cifar_stem, zero_init_residual)
    options: dict[str, Any] = {"zero_init_residual": True} if zero_init_residual else {}
    if arch in AUXILIARY_HEADS:
        options |= {"aux_logits": False} | ({"transform_input": True} if pretrained is True else {})
    model = torchvision.models.get_model(arch, weights=None, num_classes=num_classes, **options)
    if cifar_stem:
        # ImageNet's 7x7/2 conv + max-pool shrink 32 px to 8 px before the first block; the CIFAR variant
        # keeps full resolution, as in the original ResNet paper's CIFAR experiments.
        model.conv1 = nn.Conv2d(3, model.conv1.out_channels, kernel_size=3, stride=1, padding=1, bias=False)
        nn.init.kaiming_normal_(model.conv1.weight, mode="fan_out", nonlinearity="relu")
        model.maxpool = nn.Identity()
    if pretrained is True:
        load_matching(model, *torchvision_weights(arch), num_classes)
    elif pretrained:
        load_matching(model, read_weights(str(pretrained)), str(pretrained), num_classes)
    return model


def check_timm(timm: ModuleType, name: str) -> None:
    """A name timm does not register, or a weights tag after the dot that it does not have: one line."""
    if not timm.is_model(name):
        pattern = re.split(r"[_.\d]", name, maxsplit=1)[0] or name
        raise ConfigError(
            f"model.name={name} is not a timm model{close_names(name, timm.list_models())}: list them with "
            f"{TIMM_NAMES.format(pattern)}"
        )
    try:
        timm.models.get_pretrained_cfg(name)  # a tag after the dot (resnet10t.c3_in1k) must be one of its weights
    except RuntimeError as error:
        arch = name.split(".")[0]
        raise ConfigError(
            f"model.name={name}: {first_line(error)} List the tags with "
            f"python -c \"import timm; print(timm.list_pretrained('{arch}.*'))\""
        ) from error


def build_timm(
    name: str,
    num_classes: int = 10,
    pretrained: bool | str = False,
    drop_rate: float = 0.0,
    drop_path_rate: float = 0.0,
) -> nn.Module:
    """Any timm model by name (the extra imgtrain[timm], imported here only). `pretrained`: true, timm's default
    weights from the Hugging Face cache (never downloaded); a path, that file's weights (.safetensors read too).
    The head stays at init for other classes."""
    timm = optional.require("timm", "model=timm")
    check_timm(timm, name)
    # Rates of 0 are left out (timm drops None): the model's default is none, and models without the argument build.
    rates = {"drop_rate": drop_rate or None, "drop_path_rate": drop_path_rate or None}
    try:
        model = timm.create_model(name, num_classes=num_classes, **rates)
    except TypeError as error:
        if "unexpected keyword argument" not in str(error):
            raise
        raise ConfigError(
            f"model.name={name} takes no {first_line(error).rsplit(' ', 1)[-1]}: leave it at 0"
        ) from error
    if pretrained is True:
        load_matching(model, *timm_weights(timm, name), num_classes)
    elif pretrained:
        path = str(pretrained)
        load_matching(model, read_weights(path, timm.models.load_state_dict), path, num_classes)
    return model
