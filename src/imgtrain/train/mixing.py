"""Mixup and cutmix on the device batch (train.mixup_alpha, train.cutmix_alpha, train.mix_prob): torchvision's
transforms.v2.MixUp and CutMix, one of them chosen at random per mixed batch, as torchvision's classification
reference does. The loss gets the mixed labels (probabilities [B, C]); accuracy is still counted against the hard
labels. The mixed batch leaves in the memory format the model was built for (system.channels_last)."""

from __future__ import annotations

import hashlib

import torch
from torchvision.transforms import v2

from imgtrain.config.train import TrainConfig
from imgtrain.data.policies import GENERATOR_LOCK


def step_seed(seed: int, step: int) -> int:
    """A 64-bit seed that is a function of (train.seed, step) alone."""
    return int.from_bytes(hashlib.blake2b(f"{seed}/{step}".encode(), digest_size=8).digest(), "little")


class Mixing:
    """`mixing(images, labels, step) -> (images, targets)`: the identity when both alphas are 0 (the default run
    draws nothing and is unchanged). `memory_format`: the layout the model was built for (the run's, which the
    feed gives every batch); None keeps the layout each batch arrives in."""

    def __init__(
        self, train: TrainConfig, num_classes: int | None, memory_format: torch.memory_format | None = None
    ) -> None:
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
        self.memory_format = memory_format

    def __call__(self, images: torch.Tensor, labels: torch.Tensor, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(images, targets) for the batch of optimizer step `step`: mixed images with their probabilities [B, C],
        or, for a batch left unmixed, the same images and hard labels [B]. The draws (whether to mix, which mix,
        lambda, cutmix's box) come from torch's CPU generator, seeded from (train.seed, step) and put back after:
        the same step mixes the same way in a resumed run, and no other randomness moves (torch's own seeding
        would reseed the CUDA generators too, so only the CPU one is seeded). No sync: the draws are CPU numbers,
        the mix is a few ops on the device."""
        if self.transform is None:
            return images, labels
        layout = layout_of(images) if self.memory_format is None else self.memory_format
        with GENERATOR_LOCK, torch.random.fork_rng(devices=[]):  # the lock: loader threads may share the generator
            torch.default_generator.manual_seed(step_seed(self.seed, step))
            mixed, targets = self.transform(images, labels)
        # MixUp's output is `images.roll(1, 0)` scaled in place, and on CUDA roll returns a contiguous (NCHW) tensor
        # whatever its input's layout (the CPU's keeps channels_last); CutMix's output is a clone, which keeps it.
        # A batch in another layout than the model's makes a compiled forward and backward recompile ("stride
        # mismatch at index 1") and, with reduce-overhead, record a second set of CUDA graphs; eager, the first
        # convolution converts it. So the mixed batch goes back to the model's layout here. Where it has it already
        # (the CPU, CutMix, an unmixed batch) `contiguous` returns the tensor itself, no kernel; after a CUDA MixUp
        # it is one copy of the batch, each of its B x 3 x H x W floats read and written once (256 images of 224 px
        # in fp32: 154 MB each way; not measured, at an H100's ~3 TB/s some 0.1 ms), the copy an eager first
        # convolution makes.
        return mixed.contiguous(memory_format=layout), targets


def layout_of(images: torch.Tensor) -> torch.memory_format:
    """The memory format of a batch [B, C, H, W]: channels_last where it is laid out so (NHWC in memory)."""
    return torch.channels_last if images.is_contiguous(memory_format=torch.channels_last) else torch.contiguous_format
