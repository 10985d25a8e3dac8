"""Getting batches onto the device: the conversion every batch gets, a CUDA prefetch stream, GPU JPEG decoding,
device-resident datasets, and the one fixed batch of the compute ceiling.

`data.device_resident=true` keeps the whole training set as one uint8 tensor on the device and augments
whole batches there (random crop with padding, horizontal flip), with no DataLoader: the way CIFAR
speed-record code feeds a GPU.
"""

from __future__ import annotations

import contextlib
import copy
import itertools
import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import psutil
import torch
from torch.utils.data import DataLoader

from imgtrain.common.errors import ConfigError, RunError
from imgtrain.config.datasets import GpuDecoder
from imgtrain.data import batched
from imgtrain.data.ahead import prefetcher
from imgtrain.data.copies import to_device
from imgtrain.data.gpu_decode import GpuJpegBatches
from imgtrain.data.region_decode import batch_decoder
from imgtrain.data.samplers import EpochSampler
from imgtrain.data.samples import Batch, GuardedSamples, RawBatch, collate
from imgtrain.data.stages import StreamTimer

log = logging.getLogger(__name__)

RESIDENT_MAX_SHARE = 0.5  # of free device (or host) memory the uint8 training set may take


@dataclass
class Feed:
    """How each batch reaches the model: on the device, float, normalised there, in the model's memory format.

    Workers hand over uint8 images: a quarter of the bytes of float through shared memory and over PCIe.
    """

    device: torch.device
    mean: torch.Tensor  # [1, 3, 1, 1] in 0..255 units, on the device
    std: torch.Tensor
    memory_format: torch.memory_format
    non_blocking: bool  # pinned host memory: the copy need not wait for the GPU
    prefetch: bool = False  # CUDA: copy the next batch on a side stream (data.prefetch_to_device)
    decode_transforms: dict[str, Any] | None = None  # dataset.decode=cuda: each split's transform, run on the GPU
    gpu_decoder: GpuDecoder = GpuDecoder.torchvision  # dataset.gpu_decoder: what decodes them there
    copy_timer: StreamTimer | None = None  # times the host-to-device copies (CUDA events)
    decode_timer: StreamTimer | None = None  # dataset.decode=cuda: times the decode stream's work per batch

    @classmethod
    def build(
        cls,
        bundle: Any,
        device: torch.device,
        memory_format: torch.memory_format,
        *,
        pinned: bool,
        prefetch: bool,
        gpu_decode: bool,
        timed: bool = True,
        gpu_decoder: GpuDecoder = GpuDecoder.torchvision,
    ) -> Feed:
        """The feed for `bundle`'s normalisation; `prefetch` needs pinned memory (from pageable memory an
        asynchronous copy is a synchronous one), which the loader plan already checked."""
        # A split's own transform; dataset=shards keeps it apart from LitData's `transform` hook (image_transform)
        split_transform = lambda split: getattr(split, "image_transform", None) or split.transform  # noqa: E731
        transforms = (
            {"train": split_transform(bundle.train), "val": split_transform(bundle.val)} if gpu_decode else None
        )
        return cls(
            device=device,
            mean=torch.tensor(bundle.mean, device=device).view(1, 3, 1, 1) * 255.0,
            std=torch.tensor(bundle.std, device=device).view(1, 3, 1, 1) * 255.0,
            memory_format=memory_format,
            non_blocking=pinned,
            prefetch=prefetch and device.type == "cuda",
            decode_transforms=transforms,
            copy_timer=StreamTimer(device, timed),
            decode_timer=StreamTimer(device, timed and gpu_decode),
            gpu_decoder=gpu_decoder,
        )

    @contextlib.contextmanager
    def batches(self, loader_batches: Iterator[Batch], split: str = "train") -> Iterator[Iterator[Batch]]:
        """A loader's batches, through GPU JPEG decoding in a thread (dataset.decode=cuda) or, on CUDA with
        pinned memory, copied in a thread on the prefetch stream (data/ahead.py). Whatever `next()` waits for
        counts as data wait, and it is the wait for the batch it returns."""
        if self.decode_transforms is not None:
            transform = self.decode_transforms[split]
            drop = split == "val"  # validation leaves unreadable images out; training replaces them
            decoder = batch_decoder(self.gpu_decoder, transform, drop)
            with GpuJpegBatches(
                loader_batches, transform, self.device, drop=drop, timer=self.decode_timer, decoder=decoder
            ) as decoded:
                yield decoded
        elif self.prefetch and split == "train":  # the copy of batch n+1 overlaps the step on batch n
            with prefetcher(loader_batches, self.device, self.copy_timer) as ahead:
                yield ahead
        else:
            yield loader_batches

    def to_model(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        """The batch on the device as the model takes it: float32, normalised, in its memory format."""
        timed = self.copy_timer is not None and self.copy_timer.enabled and batch.images.device.type == "cpu"
        with self.copy_timer.span() if timed else contextlib.nullcontext():
            images = batch.images.to(self.device, non_blocking=self.non_blocking)
            labels = batch.labels.to(self.device, non_blocking=self.non_blocking)
        if isinstance(images, RawBatch):  # data.augment_on=device: crop, resize and flip the batch here
            images = images.resampled()
        images = images.to(dtype=torch.float32, memory_format=self.memory_format)
        return (images - self.mean) / self.std, labels


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

    def __iter__(self) -> Iterator[Batch]:
        return itertools.repeat(self.batch, self.length)


# ----------------------------------------------------------------------------- device-resident data
def check_budget(skipped: tuple[tuple[str, str], ...], limit: int | None) -> None:
    """data.max_bad_samples applied to the files left out of a device-resident training set (before any step)."""
    if limit is None or len(skipped) <= limit:
        return
    shown = "; ".join(f"{path}: {reason}" for path, reason in skipped[:3])
    raise RunError(
        f"data.max_bad_samples={limit} exceeded: {len(skipped)} training images could not be read for "
        f"data.device_resident=true (e.g. {shown}). Fix or remove those files, or raise data.max_bad_samples "
        "(null = no limit)"
    )


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


class ResidentLoader:
    """Batches gathered from a device-resident training set, augmented on the device, with no worker.

    The order comes from the same EpochSampler as the DataLoader path (sharded under DDP, resumable
    mid-epoch), and each sample's crop and flip from its seed, so resume is exact here too.
    """

    def __init__(
        self,
        images: torch.Tensor,
        labels: torch.Tensor,
        sampler: EpochSampler,
        batch_size: int,
        *,
        drop_last: bool = True,
        augment: bool = True,
    ) -> None:
        self.images, self.labels, self.sampler = images, labels, sampler
        self.batch_size, self.drop_last, self.augment = batch_size, drop_last, augment

    def __len__(self) -> int:
        full, rest = divmod(len(self.sampler), self.batch_size)
        return full + (0 if self.drop_last or not rest else 1)

    def __iter__(self) -> Iterator[Batch]:
        indices, seeds = self.sampler.order()  # NumPy: about a millisecond for 50,000 samples
        if not len(indices):
            return
        order, seeds = _to(self.images.device, indices), _to(self.images.device, seeds)
        for start in range(0, len(self) * self.batch_size, self.batch_size):
            index = order[start : start + self.batch_size]
            images = self.images[index]
            if self.augment:
                images = batched.pad_crop_flip(images, seeds[start : start + self.batch_size])
            yield Batch(images, self.labels[index])


def _to(device: torch.device, array: Any) -> torch.Tensor:
    """A host array on `device`; on CUDA through pinned memory, so the copy does not wait for the GPU."""
    return to_device(torch.from_numpy(array), device)


def build_resident(
    bundle: Any,
    make_sampler: Callable[[int], EpochSampler],
    batch_size: int,
    *,
    drop_last: bool,
    device: torch.device,
    workers: int,
    start_method: str | None,
    augment: bool,
    max_bad_samples: int | None,
) -> tuple[ResidentLoader, tuple[tuple[str, str], ...]]:
    """The training split on `device`, decoded once with the validation transform (square, image_size), with
    `workers` DataLoader workers started by `start_method` (the plan's: forkserver under torchrun, see
    data/loader.py) for that one pass; and the unreadable files left out (within data.max_bad_samples). The pass
    reads through GuardedSamples and collate, as the DataLoader path reads (whole batches cropped at once), with
    unreadable files dropped as validation drops them. The order samples what was read: `make_sampler(count)`."""
    check_fits(len(bundle.train), bundle.image_size, device)
    fixed = copy.copy(bundle.train)
    fixed.transform = bundle.val.transform  # deterministic: the crops and flips run on the device, per epoch
    samples = GuardedSamples(fixed, replace=False, timed=False)
    context = start_method if workers else None
    loader = DataLoader(
        samples, batch_size=256, num_workers=workers, multiprocessing_context=context, collate_fn=collate
    )
    batches = list(loader)
    skipped = tuple(record for batch in batches for record in batch.skipped)
    kept = [batch for batch in batches if batch.images is not None]
    if not kept:
        shown = f" (e.g. {skipped[0][0]}: {skipped[0][1]})" if skipped else ""
        raise RunError(f"data.device_resident=true: no training image could be read{shown}")
    images = torch.cat([b.images for b in kept]).to(device)
    labels = torch.cat([b.labels for b in kept]).to(device)
    check_budget(skipped, max_bad_samples)
    for path, reason in skipped:
        log.warning("data.device_resident=true: left out an unreadable image: %s: %s", path, reason)
    log.info(
        "data.device_resident=true: %d training images on %s (%.2f GB uint8)%s; crops and flips run there, batched",
        *(images.shape[0], device, images.numel() / 1e9, f", {len(skipped)} unreadable left out" if skipped else ""),
    )
    loader = ResidentLoader(images, labels, make_sampler(len(labels)), batch_size, drop_last=drop_last, augment=augment)
    return loader, skipped
