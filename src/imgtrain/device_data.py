"""Feeding the device faster than a DataLoader can: a CUDA prefetch stream, and device-resident datasets.

`data.device_resident=true` keeps the whole training set as one uint8 tensor on the device and augments
whole batches there (random crop with padding, horizontal flip), with no DataLoader: the way CIFAR
speed-record code feeds a GPU. Normalisation still happens in `Step.to_device`, as for every batch.
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Iterator
from typing import Any

import psutil
import torch
from torch.utils.data import DataLoader, Dataset

from imgtrain.config import ConfigError
from imgtrain.loader import Batch, EpochSampler

log = logging.getLogger(__name__)

RESIDENT_PAD = 4  # pixels of zero padding before the random crop (the CIFAR recipe)
RESIDENT_MAX_SHARE = 0.5  # of free device (or host) memory the uint8 training set may take


class CudaPrefetcher:
    """Copy batch n+1 to the GPU on a side stream while the model works on batch n.

    The copy is `non_blocking` from pinned memory, so it overlaps compute; the main stream waits on an
    event, not on the host. Iterates Batch objects; `inner` is the DataLoader iterator (for error handling).
    """

    def __init__(self, batches: Iterator[Batch], device: torch.device) -> None:
        self.inner = batches
        self.device = device
        self.stream = torch.cuda.Stream(device)
        self.pending: Batch | None = None
        self.started = False  # the first batch is fetched on the first next(), where errors are explained

    def _load(self) -> None:
        batch = next(self.inner, None)
        if batch is None:
            self.pending = None
            return
        if isinstance(batch.images, list):  # undecoded JPEGs: decode_jpeg does its own copy to the GPU
            self.pending = batch
            return
        with torch.cuda.stream(self.stream):
            images = batch.images.to(self.device, non_blocking=True)
            labels = batch.labels.to(self.device, non_blocking=True)
        self.pending = Batch(images, labels, batch.skipped)

    def __iter__(self) -> CudaPrefetcher:
        return self

    def __next__(self) -> Batch:
        if not self.started:
            self.started = True
            self._load()
        if self.pending is None:
            raise StopIteration
        current = torch.cuda.current_stream(self.device)
        current.wait_stream(self.stream)  # the copy of this batch has finished before the model reads it
        batch = self.pending
        if isinstance(batch.images, torch.Tensor):  # (a list is undecoded JPEGs, still on the host)
            batch.images.record_stream(current)  # its memory is not reused by the side stream too early
            batch.labels.record_stream(current)
        self._load()
        return batch


def decode_on_device(encoded: list[torch.Tensor], transform: Any, device: torch.device) -> torch.Tensor:
    """Decode a batch of JPEG byte tensors on `device` (nvJPEG on CUDA), transform each image there, stack.

    The random crops use the training process's torch generator, not the per-sample seeds, so with
    dataset.decode=cuda augmentation is reproducible from the seed but not bit-exact across a resume.
    """
    from torchvision.io import ImageReadMode, decode_jpeg

    images = decode_jpeg(encoded, mode=ImageReadMode.RGB, device=device)
    return torch.stack([transform(image).contiguous() for image in images])


# ----------------------------------------------------------------------------- device-resident data
def materialize(dataset: Dataset, transform: Any, device: torch.device, workers: int) -> tuple[torch.Tensor, ...]:
    """Decode a whole dataset once with a deterministic `transform`: (uint8 images [N,3,S,S], labels [N])."""
    fixed = copy.copy(dataset)
    fixed.transform = transform
    loader = DataLoader(fixed, batch_size=256, num_workers=workers)
    images, labels = zip(*loader, strict=True)
    return torch.cat(images).to(device), torch.cat(labels).to(device)


def check_fits(num_images: int, image_size: int, device: torch.device) -> None:
    """Refuse (one line) a training set that would take more than half of the free device memory."""
    needed = num_images * 3 * image_size * image_size
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
    else:
        free = psutil.virtual_memory().available
    if needed > RESIDENT_MAX_SHARE * free:
        raise ConfigError(
            f"data.device_resident=true needs {needed / 1e9:.1f} GB for the training set as uint8, but "
            f"{device} has {free / 1e9:.1f} GB free: use data.device_resident=false (the DataLoader) or a smaller "
            "dataset.image_size"
        )


def pad_crop_flip(images: torch.Tensor, seeds: torch.Tensor, pad: int = RESIDENT_PAD) -> torch.Tensor:
    """Per-sample random crop (after `pad` pixels of zeros) and horizontal flip, batched, on the images' device.

    The offsets and flips come from each sample's seed, so they are the same whatever the batch or device.
    """
    n, channels, height, width = images.shape
    span = 2 * pad + 1
    dx, dy, flip = seeds % span, (seeds // span) % span, (seeds // (span * span)) % 2 == 1
    padded = torch.nn.functional.pad(images, (pad, pad, pad, pad))
    rows = (dy[:, None] + torch.arange(height, device=images.device))[:, None, :, None]
    cols = (dx[:, None] + torch.arange(width, device=images.device))[:, None, None, :]
    batch = torch.arange(n, device=images.device)[:, None, None, None]
    chan = torch.arange(channels, device=images.device)[None, :, None, None]
    crops = padded[batch, chan, rows, cols]
    return torch.where(flip[:, None, None, None], crops.flip(-1), crops)


class ResidentLoader:
    """Batches gathered from a device-resident training set, augmented on the device, with no worker.

    The order comes from the same EpochSampler as the DataLoader path (sharded under DDP, resumable
    mid-epoch), and each sample's crop and flip from its seed, so resume is exact here too.
    """

    def __init__(self, images: torch.Tensor, labels: torch.Tensor, sampler: EpochSampler, batch_size: int, **kw):
        self.images, self.labels, self.sampler = images, labels, sampler
        self.batch_size = batch_size
        self.drop_last = kw.get("drop_last", True)
        self.augment = kw.get("augment", True)

    def __len__(self) -> int:
        full, rest = divmod(len(self.sampler), self.batch_size)
        return full + (0 if self.drop_last or not rest else 1)

    def __iter__(self) -> Iterator[Batch]:
        pairs = list(self.sampler)
        if not pairs:
            return
        device = self.images.device
        order = torch.tensor([index for index, _ in pairs], device=device)
        seeds = torch.tensor([seed for _, seed in pairs], device=device)
        for start in range(0, len(self) * self.batch_size, self.batch_size):
            index = order[start : start + self.batch_size]
            images = self.images[index]
            if self.augment:
                images = pad_crop_flip(images, seeds[start : start + self.batch_size])
            yield Batch(images, self.labels[index])


def build_resident(bundle: Any, sampler: EpochSampler, batch_size: int, drop_last: bool, **kw) -> ResidentLoader:
    """The training split on `device`, decoded once with the validation transform (square, image_size).

    kw: device, workers (DataLoader workers for that one decoding pass), augment.
    """
    device, workers = kw["device"], kw["workers"]
    check_fits(len(bundle.train), bundle.image_size, device)
    images, labels = materialize(bundle.train, bundle.val.transform, device, workers)
    log.info(
        "data.device_resident=true: %d training images on %s (%.2f GB uint8); crops and flips run there, batched",
        *(images.shape[0], device, images.numel() / 1e9),
    )
    return ResidentLoader(images, labels, sampler, batch_size, drop_last=drop_last, augment=kw["augment"])
