"""The `train` group's schema (conf/train/): the recipe, how long, from which seed, mixing and the weights' average."""

from __future__ import annotations

from dataclasses import dataclass

from imgtrain.config.fields import at_least, checked


@dataclass
class TrainConfig:
    """The recipe: how long, from which seed, mixing and the weights' average. train.<key>=..."""

    epochs: int = checked(5, at_least(1))
    max_steps: int | None = checked(None, at_least(1, null=""))  # stop after this many optimizer steps
    seed: int = 0
    # mixup/cutmix on the device batch (torchvision.transforms.v2.MixUp/CutMix); 0 = off. With both on, each
    # mixed batch uses one of them, chosen at random, as torchvision's reference does
    mixup_alpha: float = checked(0.0, at_least(0, "a number", note="0 = off"))
    cutmix_alpha: float = checked(0.0, at_least(0, "a number", note="0 = off"))
    mix_prob: float = checked(1.0, lambda v: None if 0.0 <= v <= 1.0 else "expected a probability in [0, 1]")
    # an exponential moving average of the weights (torch.optim.swa_utils.AveragedModel), validated beside them
    ema_decay: float | None = checked(None, lambda v: None if v is None or 0.0 < v < 1.0 else "expected null or (0, 1)")
    ema_every_n_steps: int = checked(1, at_least(1, note="optimizer steps between EMA updates"))
