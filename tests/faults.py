"""Fault injection for subprocess tests: a model whose loss turns NaN at chosen training steps.

Used as `model._target_=faults.build_nan_model` with tests/ on PYTHONPATH. IMGTRAIN_FAULT_NAN_CALLS lists the
1-based training forward passes that return NaN logits; IMGTRAIN_FAULT_RANK limits that to one rank.
"""

from __future__ import annotations

import os

import torch
from torch import nn

from imgtrain.train.model import build_torchvision


class NaNAt(nn.Module):
    def __init__(self, net: nn.Module, calls: set[int], rank: int | None) -> None:
        super().__init__()
        self.net, self.calls, self.rank, self.count = net, calls, rank, 0

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        logits = self.net(images)
        if not self.training:
            return logits
        self.count += 1
        mine = self.rank is None or self.rank == int(os.environ.get("RANK", "0"))
        return logits * float("nan") if mine and self.count in self.calls else logits


def build_nan_model(num_classes: int, **torchvision_keys: object) -> nn.Module:
    """`torchvision_keys`: the keys of model=torchvision's schema (arch, cifar_stem, ...), passed on."""
    calls = {int(c) for c in os.environ.get("IMGTRAIN_FAULT_NAN_CALLS", "").split(",") if c}
    rank = os.environ.get("IMGTRAIN_FAULT_RANK")
    net = build_torchvision(num_classes=num_classes, **torchvision_keys)
    return NaNAt(net, calls, int(rank) if rank else None)
