"""Images already in memory as one uint8 tensor (CIFAR, synthetic): no read or decode stage, and the transforms
CIFAR and synthetic use applied to a whole batch at once."""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import torch
import torchvision.transforms.v2.functional as F
from torch.utils.data import Dataset
from torchvision.transforms import v2

from imgtrain.data import batched, stages


class TensorImageDataset(Dataset):
    """Images already in memory as one uint8 tensor [N, 3, H, W], with an optional transform."""

    def __init__(self, images: torch.Tensor, labels: np.ndarray, classes: list[str], transform: Any = None):
        self.images = images
        self.labels = np.asarray(labels, dtype=np.int64)
        self.classes = list(classes)
        self.transform = transform

    def __len__(self) -> int:
        return len(self.labels)

    @property
    def batchable(self) -> bool:
        """Whether `batch_items` can transform a whole batch at once (the transforms CIFAR and synthetic use)."""
        return _tensor_batch_steps(self.transform, self.images.shape[-1]) is not None

    def batch_items(self, indices: list[int], seeds: list[int], timed: bool) -> list[tuple]:
        """A batch's samples at once, as GuardedSamples gives them: one gather, then the transform applied to the
        batch (CIFAR's padded crop and flip drawn from each sample's seed, data/batched.py) instead of per image."""
        started = time.perf_counter()
        pad, size = _tensor_batch_steps(self.transform, self.images.shape[-1])
        images = self.images[torch.as_tensor(indices)]
        if pad is not None:
            images = batched.pad_crop_flip(images, torch.as_tensor(seeds, dtype=torch.int64), pad)
        if size is not None and size != images.shape[-1]:
            images = F.resize(images, [size, size], antialias=True)
        share = (time.perf_counter() - started) / len(indices)
        times = (0.0, 0.0, share, share) if timed else None  # in memory: nothing to read or decode
        return [(image, int(label), (), times) for image, label in zip(images, self.labels[indices], strict=True)]

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        started = time.perf_counter()
        image = self.images[index]
        if self.transform is not None:
            image = self.transform(image)
        image = image.contiguous()
        stages.record(augment=time.perf_counter() - started)  # in memory: nothing to read or decode
        return image, int(self.labels[index])


def _tensor_batch_steps(transform: Any, side: int) -> tuple[int | None, int | None] | None:
    """(padding of a random crop with flip, square resize side) when `transform` is one of those CIFAR and
    synthetic use: none, a square Resize, or RandomCrop(side, padding) + RandomHorizontalFlip(0.5) [+ Resize]."""
    steps = (
        list(transform.transforms) if isinstance(transform, v2.Compose) else [] if transform is None else [transform]
    )
    size = None
    if steps and isinstance(steps[-1], v2.Resize) and batched.square_bilinear_resize(steps[-1]):
        size = steps.pop().size[0]
    if not steps:
        return None, size
    if len(steps) == 2 and isinstance(steps[0], v2.RandomCrop) and isinstance(steps[1], v2.RandomHorizontalFlip):
        crop, flip = steps
        padding = crop.padding
        even = isinstance(padding, int) or (padding is not None and len(set(padding)) == 1)
        zeros = crop.padding_mode == "constant" and crop.fill in (0, {})
        if list(crop.size) == [side, side] and even and zeros and flip.p == 0.5:
            return (padding if isinstance(padding, int) else padding[0]), size
    return None
