"""The model: any of torchvision's or timm's by name (and mode=loader's stand-in), precision, memory format, DDP
and compile."""

from __future__ import annotations

import difflib
import logging
import re
from types import ModuleType
from typing import Any

import torch
import torchvision
from hydra.utils import instantiate
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from imgtrain.common.errors import ConfigError, first_line
from imgtrain.config.schema import (
    AUTO,
    Config,
    Mode,
    Precision,
    SystemConfig,
    TimmModelConfig,
    TorchvisionModelConfig,
    model_name,
)
from imgtrain.host import dist, optional
from imgtrain.train.pretrained import load_matching, read_weights, timm_weights, torchvision_weights

log = logging.getLogger(__name__)

BF16_MIN_CAPABILITY = (8, 0)  # Ampere: native bf16 tensor cores. Older GPUs only emulate it, slowly.


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


def check_model(model: Any) -> None:
    """The model's name and options checked before any work starts (its builder checks them again): an unknown
    name or a ResNet-only option elsewhere is one line. A fork's own builder is left to itself."""
    if isinstance(model, TorchvisionModelConfig) and model._target_ == TorchvisionModelConfig._target_:
        check_torchvision(model.arch, model.cifar_stem, model.zero_init_residual)
    elif isinstance(model, TimmModelConfig) and model._target_ == TimmModelConfig._target_:
        check_timm(optional.require("timm", "model=timm"), model.name)


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


class LoaderProbe(nn.Module):
    """mode=loader's model: reads every pixel of the batch (one mean) and has 10 parameters, so the same loop
    runs with the model's cost taken out, and what is left is the input pipeline and the copy."""

    def __init__(self, num_classes: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(1, num_classes))

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return images.mean(dim=(1, 2, 3))[:, None] * self.weight


def count_parameters(model: nn.Module) -> int:
    """Number of trainable parameters."""
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


def resolve_precision(requested: str, device: torch.device) -> Precision:
    """`auto` is bf16 on GPUs with native bf16 (compute capability 8.0+), else fp32; reject what cannot run."""
    cuda = device.type == "cuda"
    # The device in use, not device 0; torch.cuda.is_bf16_supported() also says yes where bf16 is emulated.
    capability = torch.cuda.get_device_capability(device) if cuda else None
    bf16_ok = cuda and capability >= BF16_MIN_CAPABILITY
    if requested == Precision.auto:
        return Precision.bf16 if bf16_ok else Precision.fp32
    if requested == Precision.fp16 and not cuda:
        raise ConfigError("system.precision=fp16 needs a CUDA device: on CPU use fp32 or bf16")
    if requested == Precision.bf16 and cuda and not bf16_ok:
        major, minor = capability
        raise ConfigError(
            f"system.precision=bf16 needs compute capability 8.0 or higher, and {device} has {major}.{minor}: "
            "use system.precision=fp16 or fp32"
        )
    return Precision(requested)


def memory_format_for(channels_last: bool | str, device: torch.device) -> torch.memory_format:
    """`auto` is channels_last on CUDA: NHWC lets cuDNN use tensor-core convolutions directly."""
    on = device.type == "cuda" if channels_last == AUTO else bool(channels_last)
    return torch.channels_last if on else torch.contiguous_format


def prepare_model(
    settings: Config,
    num_classes: int,
    device: torch.device,
    memory_format: torch.memory_format,
    info: dist.DistInfo,
) -> tuple[nn.Module, nn.Module]:
    """(the module to call, the underlying one for saving and parameter groups): DDP and compile as set."""
    if settings.mode == Mode.loader:
        model = LoaderProbe(num_classes)  # the input pipeline's ceiling: no model cost, the same loop
    else:
        model = instantiate(settings.model, num_classes=num_classes)
    model = model.to(device, memory_format=memory_format)
    log.info(
        "model: %s, %.1fM parameters, %s", model_name(settings.model), count_parameters(model) / 1e6, memory_format
    )
    base = model
    if info.enabled:
        # broadcast_buffers (DDP's default): every forward first broadcasts rank 0's BatchNorm statistics, one
        # coalesced collective of 39 KB for ResNet-18 and 213 KB for ResNet-50, a few tens of microseconds on
        # NVLink beside a step of milliseconds (not measured here: one GPU). Without it each rank's statistics
        # drift apart and the checkpoint (rank 0's) would not be the model the other ranks validate.
        device_ids = [device.index] if device.type == "cuda" else None
        model = DistributedDataParallel(model, device_ids=device_ids, broadcast_buffers=True)
    return compiled(model, settings.system), base


def compiled(model: nn.Module, system: SystemConfig) -> nn.Module:
    """`model` through torch.compile in system.compile_mode, or itself with system.compile=false. Compiled
    around DDP (not inside it), so Dynamo splits the graph at DDP's buckets and their all-reduces overlap the
    backward pass."""
    return torch.compile(model, mode=str(system.compile_mode)) if system.compile else model


def uncompiled(model: nn.Module) -> nn.Module:
    """The module under torch.compile's wrapper (itself when not compiled)."""
    return getattr(model, "_orig_mod", model)


def evaluation_module(model: nn.Module, cuda_graphs: bool = False) -> nn.Module:
    """The module validation calls. Under DDP, the wrapped module itself: DDP's forward broadcasts the buffers
    (BatchNorm statistics) from rank 0 on every call, a collective that hangs when the ranks have different numbers
    of validation batches (LitData does not pad its shares; ShardSampler's can differ by one at a batch boundary).
    The buffers are broadcast once here instead, as DDP's first forward did, so the figures do not change. With
    system.compile=true under DDP, validation therefore runs uncompiled. So it does with `cuda_graphs` (a compile
    mode that records them): validation's batch size and its last, smaller batch would each record graphs of
    their own, in memory held for the rest of the run."""
    wrapped = uncompiled(model)  # torch.compile's wrapper around DDP
    if not isinstance(wrapped, DistributedDataParallel):
        return wrapped if cuda_graphs else model
    for buffer in wrapped.module.buffers():
        torch.distributed.broadcast(buffer, src=0)
    return wrapped.module
