"""Where and how the model runs, around what a builder of train/model.py returns: its precision, memory format,
DDP and torch.compile (CUDA graphs among its modes), the module validation calls, and mode=loader's stand-in
model. A fork's model needs nothing here."""

from __future__ import annotations

import logging
from typing import Any

import torch
from hydra.utils import instantiate
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from imgtrain.common.errors import ConfigError
from imgtrain.config.fields import AUTO
from imgtrain.config.model import TimmModelConfig, TorchvisionModelConfig, model_name
from imgtrain.config.schema import Config, Mode
from imgtrain.config.system import Precision, SystemConfig
from imgtrain.host import dist, optional
from imgtrain.train.model import check_timm, check_torchvision

log = logging.getLogger(__name__)

BF16_MIN_CAPABILITY = (8, 0)  # Ampere: native bf16 tensor cores. Older GPUs only emulate it, slowly.


def check_model(model: Any) -> None:
    """The model's name and options checked before any work starts (its builder checks them again): an unknown
    name or a ResNet-only option elsewhere is one line. A fork's own builder is left to itself."""
    if isinstance(model, TorchvisionModelConfig) and model._target_ == TorchvisionModelConfig._target_:
        check_torchvision(model.arch, model.cifar_stem, model.zero_init_residual)
    elif isinstance(model, TimmModelConfig) and model._target_ == TimmModelConfig._target_:
        check_timm(optional.require("timm", "model=timm"), model.name)


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


def parameters_text(count: int) -> str:
    """`count` to 3 significant figures and a unit, as the log says it: 11.2M, 12.3k, 10 (a tiny model's 0.01M
    read 0.0M at one decimal)."""
    rounded = float(f"{count:.3g}")
    scale, unit = next(((s, u) for s, u in ((1e9, "G"), (1e6, "M"), (1e3, "k")) if rounded >= s), (1, ""))
    return f"{rounded / scale:.3g}{unit}"


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
    count = parameters_text(count_parameters(model))
    log.info("model: %s, %s parameters, %s", model_name(settings.model), count, memory_format)
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
