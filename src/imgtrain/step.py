"""What the loop needs besides the loop: precision, the model, and the optimiser/scheduler/scaler bundle."""

from __future__ import annotations

import contextlib
import itertools
import logging
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from hydra.utils import instantiate
from omegaconf import DictConfig
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from imgtrain import dist
from imgtrain.config import AUTO, Config, ConfigError
from imgtrain.device_data import CudaPrefetcher, GpuJpegBatches
from imgtrain.loader import Batch
from imgtrain.models import count_parameters, param_groups, warmup_cosine

log = logging.getLogger(__name__)

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


BF16_MIN_CAPABILITY = (8, 0)  # Ampere: native bf16 tensor cores. Older GPUs only emulate it, slowly.


def resolve_precision(requested: str, device: torch.device) -> str:
    """`auto` is bf16 on GPUs with native bf16 (compute capability 8.0+), else fp32; reject what cannot run."""
    cuda = device.type == "cuda"
    # The device in use, not device 0; torch.cuda.is_bf16_supported() also says yes where bf16 is emulated.
    capability = torch.cuda.get_device_capability(device) if cuda else None
    bf16_ok = cuda and capability >= BF16_MIN_CAPABILITY
    if requested == AUTO:
        return "bf16" if bf16_ok else "fp32"
    if requested == "fp16" and not cuda:
        raise ConfigError("trainer.precision=fp16 needs a CUDA device: on CPU use fp32 or bf16")
    if requested == "bf16" and cuda and not bf16_ok:
        major, minor = capability
        raise ConfigError(
            f"trainer.precision=bf16 needs compute capability 8.0 or higher, and {device} has {major}.{minor}: "
            "use trainer.precision=fp16 or fp32"
        )
    return requested


@dataclass
class Step:
    """What the loop needs besides the model: built once, used every step."""

    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    scaler: torch.amp.GradScaler
    device: torch.device
    dtype: torch.dtype
    memory_format: torch.memory_format
    mean: torch.Tensor  # [1, 3, 1, 1] in 0..255 units, on the device
    std: torch.Tensor
    non_blocking: bool
    label_smoothing: float
    info: dist.DistInfo
    mode: str = "train"  # train; loader: input pipeline only, no model; compute: model only, one batch on device
    prefetch_to_device: bool = False
    decode_transforms: dict[str, Any] | None = None  # per split, when dataset.decode=cuda: the GPU decodes

    def to_device(self, images: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Copy a uint8 batch to the device, then convert and normalise there (4x fewer bytes than float)."""
        images = images.to(self.device, non_blocking=self.non_blocking)
        labels = labels.to(self.device, non_blocking=self.non_blocking)
        images = images.to(dtype=torch.float32, memory_format=self.memory_format)
        return (images - self.mean) / self.std, labels

    @contextlib.contextmanager
    def batches(self, loader_batches: Any, split: str = "train") -> Iterator[Any]:
        """The loop's batch iterator over a loader's: GPU JPEG decoding ahead in a thread (dataset.decode=cuda)
        or, on CUDA with pinned memory, the next batch's copy on a side stream (data.prefetch_to_device).
        Whatever the loop waits for in `next()` its data-wait timer counts as input time."""
        if self.decode_transforms is not None:
            with GpuJpegBatches(loader_batches, self.decode_transforms[split], self.device) as decoded:
                yield decoded
        elif self.prefetch_to_device and split == "train":
            yield CudaPrefetcher(loader_batches, self.device)
        else:
            yield loader_batches

    def autocast(self) -> contextlib.AbstractContextManager:
        return torch.autocast(self.device.type, dtype=self.dtype, enabled=self.dtype != torch.float32)

    def state_dict(self) -> dict[str, Any]:
        """Optimizer, LR schedule and loss-scaler state, for checkpoints."""
        return {
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "scaler": self.scaler.state_dict(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        if state["scaler"]:  # empty when the scaler was off (fp32/bf16)
            self.scaler.load_state_dict(state["scaler"])


class DeviceBatches:
    """mode=compute: the same random uint8 batch, already on the device, `length` times per epoch."""

    sampler = None

    def __init__(self, batch: Batch, length: int) -> None:
        self.batch, self.length = batch, length

    @classmethod
    def random(cls, bundle: Any, batch_size: int, length: int, device: torch.device) -> DeviceBatches:
        size = (batch_size, 3, bundle.image_size, bundle.image_size)
        images = torch.randint(0, 256, size, dtype=torch.uint8, device=device)
        return cls(Batch(images, torch.randint(0, bundle.num_classes, (batch_size,), device=device)), length)

    def __len__(self) -> int:
        return self.length

    def __iter__(self):
        return itertools.repeat(self.batch, self.length)


def build_model(
    cfg: DictConfig, settings: Config, num_classes: int, device: torch.device, info: dist.DistInfo
) -> tuple[nn.Module, nn.Module, torch.memory_format]:
    """Return (model to call, underlying module for saving and param groups, input memory format)."""
    model = instantiate(cfg.model, num_classes=num_classes)
    channels_last = settings.trainer.channels_last
    if channels_last == AUTO:
        channels_last = device.type == "cuda"  # NHWC lets cuDNN use tensor-core convolutions directly
    memory_format = torch.channels_last if channels_last else torch.contiguous_format
    model = model.to(device, memory_format=memory_format)
    log.info("model: %s, %.1fM parameters, %s", settings.model.arch, count_parameters(model) / 1e6, memory_format)
    base = model
    if info.enabled:
        model = DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)
    if settings.trainer.compile:
        model = torch.compile(model)
    return model, base, memory_format


def make_step(
    cfg: DictConfig,
    settings: Config,
    base: nn.Module,
    bundle: Any,
    *,
    device: torch.device,
    precision: str,
    memory_format: torch.memory_format,
    steps: tuple[int, int],
    pinned: bool,
    prefetch: bool,
    info: dist.DistInfo,
) -> Step:
    """Optimiser, LR schedule, scaler and input conversion. `steps` is (steps per epoch, total steps)."""
    cuda = device.type == "cuda"
    # fused=True on CUDA: one kernel for the whole update instead of a few per parameter tensor (AdamW on
    # ResNet-18 at 32 px on an H100: 30.8k -> 47.8k img/s, benchmarks/).
    fused = {"fused": True} if cuda else {}
    optimizer = instantiate(cfg.optim, params=param_groups(base, settings.optim.weight_decay), _convert_="all", **fused)
    steps_per_epoch, total_steps = steps
    warmup = round(settings.trainer.lr_warmup_epochs * steps_per_epoch)
    gpu_decode = getattr(settings.dataset, "decode", "cpu") == "cuda"
    return Step(
        optimizer=optimizer,
        scheduler=warmup_cosine(optimizer, warmup, total_steps),
        scaler=torch.amp.GradScaler(device.type, enabled=precision == "fp16"),
        device=device,
        dtype=DTYPES[precision],
        memory_format=memory_format,
        mean=torch.tensor(bundle.mean, device=device).view(1, 3, 1, 1) * 255.0,
        std=torch.tensor(bundle.std, device=device).view(1, 3, 1, 1) * 255.0,
        non_blocking=pinned,
        # an async copy needs page-locked memory; from pageable memory it is a synchronous copy
        prefetch_to_device=prefetch and cuda and settings.mode != "compute",
        label_smoothing=settings.trainer.label_smoothing,
        decode_transforms={"train": bundle.train.transform, "val": bundle.val.transform} if gpu_decode else None,
        info=info,
        mode=settings.mode,
    )
