"""Mixup and cutmix on the device batch (train.mixup_alpha, train.cutmix_alpha, train.mix_prob): torchvision's
transforms.v2.MixUp and CutMix, one of them chosen at random per mixed batch, as torchvision's classification
reference does. The loss gets the mixed labels (probabilities [B, C]); accuracy is still counted against the hard
labels."""

from __future__ import annotations

import hashlib

import torch
from torchvision.transforms import v2

from imgtrain.config.schema import TrainConfig


def step_seed(seed: int, step: int) -> int:
    """A 64-bit seed that is a function of (train.seed, step) alone."""
    return int.from_bytes(hashlib.blake2b(f"{seed}/{step}".encode(), digest_size=8).digest(), "little")


class Mixing:
    """`mixing(images, labels, step) -> (images, targets)`: the identity when both alphas are 0 (the default run
    draws nothing and is unchanged)."""

    def __init__(self, train: TrainConfig, num_classes: int | None) -> None:
        mixes: list[v2.Transform] = []
        if train.mixup_alpha > 0:
            mixes.append(v2.MixUp(alpha=train.mixup_alpha, num_classes=num_classes))
        if train.cutmix_alpha > 0:
            mixes.append(v2.CutMix(alpha=train.cutmix_alpha, num_classes=num_classes))
        if mixes and not num_classes:
            raise ValueError("mixup/cutmix need the number of classes: pass num_classes to build_step")
        # mix_prob: the chance that a batch is mixed at all (RandomApply); else it keeps its images and hard labels
        self.transform = v2.RandomApply([v2.RandomChoice(mixes)], p=train.mix_prob) if mixes else None
        self.seed = train.seed

    def __call__(self, images: torch.Tensor, labels: torch.Tensor, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(images, targets) for the batch of optimizer step `step`: mixed images with their probabilities [B, C],
        or, for a batch left unmixed, the same images and hard labels [B]. The draws (whether to mix, which mix,
        lambda, cutmix's box) come from torch's CPU generator, seeded from (train.seed, step) and put back after:
        the same step mixes the same way in a resumed run, and no other randomness moves (torch's own seeding
        would reseed the CUDA generators too, so only the CPU one is seeded). No sync: the draws are CPU numbers,
        the mix is a few ops on the device."""
        if self.transform is None:
            return images, labels
        with torch.random.fork_rng(devices=[]):
            torch.default_generator.manual_seed(step_seed(self.seed, step))
            return self.transform(images, labels)
