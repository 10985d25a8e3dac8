"""Model builders, called through `hydra.utils.instantiate(cfg.model, num_classes=...)`."""

from __future__ import annotations

import math

import torch
import torchvision
from torch import nn


def build_model(
    arch: str = "resnet18", num_classes: int = 10, cifar_stem: bool = False, zero_init_residual: bool = False
) -> nn.Module:
    """A torchvision ResNet, optionally with the CIFAR stem (3x3 stride-1 conv, no max-pool) for 32-px input."""
    builder = getattr(torchvision.models, arch)
    model = builder(weights=None, num_classes=num_classes, zero_init_residual=zero_init_residual)
    if cifar_stem:
        # ImageNet's 7x7/2 conv + max-pool shrink 32 px to 8 px before the first block; the CIFAR variant
        # keeps full resolution, as in the original ResNet paper's CIFAR experiments.
        model.conv1 = nn.Conv2d(3, 64, kernel_size=3, stride=1, padding=1, bias=False)
        nn.init.kaiming_normal_(model.conv1.weight, mode="fan_out", nonlinearity="relu")
        model.maxpool = nn.Identity()
    return model


def count_parameters(model: nn.Module) -> int:
    """Number of trainable parameters."""
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """Split parameters so weight decay skips BatchNorm weights and biases (1-d tensors), as timm does."""
    decay, no_decay = [], []
    for param in model.parameters():
        if param.requires_grad:
            (no_decay if param.ndim <= 1 else decay).append(param)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def warmup_cosine(optimizer: torch.optim.Optimizer, warmup_steps: int, total_steps: int):
    """Linear warmup from ~0 to the base LR over `warmup_steps`, then cosine decay to zero at `total_steps`."""

    def factor(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        progress = (step - warmup_steps) / max(1, total_steps - warmup_steps)
        return 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
