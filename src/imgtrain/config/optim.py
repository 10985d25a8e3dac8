"""The `optim` group's typed schemas (conf/optim/): any torch.optim optimizer is accepted by `_target_`; these two
are the ready-made ones."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SGDConfig:
    _target_: str = "torch.optim.SGD"
    lr: float = 0.1  # for the global batch; scale it with world_size x batch_size
    momentum: float = 0.9
    weight_decay: float = 5e-4  # not applied to BatchNorm weights and biases
    nesterov: bool = True
    scale_lr_with_batch: bool = False  # true: lr x global batch / 256 (Goyal et al.), said in the log


@dataclass
class AdamWConfig:
    _target_: str = "torch.optim.AdamW"
    lr: float = 2e-3
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    weight_decay: float = 0.05  # not applied to BatchNorm weights and biases
    scale_lr_with_batch: bool = False  # true: lr x global batch / 256 (Goyal et al.), said in the log
