"""Feeding the device faster than a DataLoader can: a CUDA prefetch stream, and device-resident datasets.

`data.device_resident=true` keeps the whole training set as one uint8 tensor on the device and augments
whole batches there (random crop with padding, horizontal flip), with no DataLoader: the way CIFAR
speed-record code feeds a GPU. Normalisation still happens in `Step.to_device`, as for every batch.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import queue
import threading
from collections.abc import Iterator
from typing import Any

import psutil
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset
from torchvision.io import ImageReadMode, decode_jpeg
from torchvision.transforms import RandomResizedCrop as RandomResizedCropParams
from torchvision.transforms import v2

from imgtrain.config import ConfigError, RunError
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
        with torch.cuda.stream(self.stream):
            self.pending = self._on_device(batch)

    def _on_device(self, batch: Batch) -> Batch:
        """Runs on the side stream: start the batch's copy to the device."""
        images = batch.images.to(self.device, non_blocking=True)
        labels = batch.labels.to(self.device, non_blocking=True)
        return Batch(images, labels, batch.skipped)

    def __iter__(self) -> CudaPrefetcher:
        return self

    def __next__(self) -> Batch:
        if not self.started:
            self.started = True
            self._load()
        if self.pending is None:
            raise StopIteration
        current = torch.cuda.current_stream(self.device)
        current.wait_stream(self.stream)  # the side stream's work on this batch is done before the model reads it
        batch = self.pending
        batch.images.record_stream(current)  # its memory is not reused by the side stream too early
        batch.labels.record_stream(current)
        self._load()
        return batch


class GpuJpegBatches:
    """dataset.decode=cuda: a background thread decodes each batch's JPEGs with nvJPEG and transforms them on
    its own CUDA stream, up to `depth` batches ahead of the model.

    torchvision's GPU decode blocks the calling thread until the batch is decoded; in a thread of its own it
    overlaps the training step, so the loop's data wait (time blocked in `next()`) is real starvation. Use it
    as a context manager: leaving stops the thread before the loader is used again. `inner` is the loader's
    iterator (for explaining its failures).
    """

    _END = object()

    def __init__(self, batches: Iterator[Batch], transform: Any, device: torch.device, depth: int = 2) -> None:
        self.inner = batches
        self.device = device
        self.decoder = JpegBatchDecoder(transform)
        self.ready: queue.Queue = queue.Queue(maxsize=depth)
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self._decode_all, name="gpu-jpeg-decode", daemon=True)

    def _decode_all(self) -> None:
        """The thread: decode batch after batch; an error is handed to the loop, which raises it."""
        stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        try:
            with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
                for batch in self.inner:
                    if self.stopping.is_set():
                        return
                    decoded = self.decoder(batch, self.device)
                    done = stream.record_event() if stream is not None else None
                    self._hand_over((decoded, done))
            self._hand_over(self._END)
        except BaseException as error:  # noqa: BLE001 - raised again in the training thread
            self._hand_over(error)

    def _hand_over(self, item: Any) -> None:
        while not self.stopping.is_set():
            try:
                self.ready.put(item, timeout=0.1)
                return
            except queue.Full:
                continue

    def __enter__(self) -> GpuJpegBatches:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stopping.set()
        while self.thread.is_alive():  # the thread may be waiting for a worker's batch: let it finish
            with contextlib.suppress(queue.Empty):
                self.ready.get(timeout=0.1)

    def __iter__(self) -> GpuJpegBatches:
        return self

    def __next__(self) -> Batch:
        item = self.ready.get()
        if item is self._END:
            self.ready.put(self._END)  # every later next() ends too
            raise StopIteration
        if isinstance(item, BaseException):
            raise item
        batch, done = item
        if done is not None:
            current = torch.cuda.current_stream(self.device)
            current.wait_event(done)  # the GPU, not this thread, waits for the decode stream
            batch.images.record_stream(current)  # not reused by the decode stream while the model reads it
            batch.labels.record_stream(current)
        return batch


def decode_jpegs(encoded: list[torch.Tensor], device: torch.device) -> list[torch.Tensor | str]:
    """Decode JPEG byte tensors on `device`: each entry is a uint8 image [3, H, W], or why that file failed.

    One bad file fails torchvision's whole batched call, so a failed batch is decoded again file by file.
    """
    try:
        return list(_fenced_decode(encoded, device))
    except RuntimeError:
        decoded: list[torch.Tensor | str] = []
        for data in encoded:
            try:
                decoded.append(_fenced_decode([data], device)[0])
            except RuntimeError as error:
                decoded.append(str(error).strip().splitlines()[0] if str(error).strip() else "cannot be decoded")
        return decoded


def _fenced_decode(encoded: list[torch.Tensor], device: torch.device) -> list[torch.Tensor]:
    if device.type == "cuda":
        # torchvision allocates the outputs on the current stream, then nvJPEG writes them from its own stream
        # (its hardware engine ignores stream order altogether). Memory freed while kernels queued on this
        # stream still read it can be handed straight to the decoder: drain the stream first
        # (pytorch/vision#9606, meta-pytorch/torchcodec#1634). On the prefetch stream that is only the
        # previous batch's resizes, not the training step.
        torch.cuda.current_stream(device).synchronize()
    return decode_jpeg(encoded, mode=ImageReadMode.RGB, device=device)


class JpegBatchDecoder:
    """Decode a Batch of undecoded JPEGs and apply the split's transform, batched where the transform allows.

    Files that fail to decode are replaced by another image of the same batch (and its label) and reported
    in `skipped`, as GuardedSamples does for the CPU path, so they count against data.max_bad_samples.
    """

    def __init__(self, transform: Any) -> None:
        steps = list(transform.transforms) if isinstance(transform, v2.Compose) else [transform]
        self.flip_p = steps.pop().p if steps and isinstance(steps[-1], v2.RandomHorizontalFlip) else 0.0
        self.per_image = v2.Compose(steps)
        # Deterministic resizes and crops give every image of one size the same output: one call per size.
        self.same_for_all = all(isinstance(step, (v2.Resize, v2.CenterCrop)) for step in steps)
        # A bilinear RandomResizedCrop alone: crop views and one interpolate call per image, ~10x less Python
        # than the v2 transform per image (ResNet-50, 256 JPEGs of 384 px on an H100: see BENCHMARKS.md).
        only = steps[0] if len(steps) == 1 else None
        mode = getattr(only, "interpolation", None)  # an InterpolationMode, or its value as a string (0.29)
        bilinear = str(getattr(mode, "value", mode)).lower() == "bilinear"
        self.random_crop = only if isinstance(only, v2.RandomResizedCrop) and bilinear else None

    def __call__(self, batch: Batch, device: torch.device) -> Batch:
        decoded = decode_jpegs(batch.images, device)
        good = [i for i, image in enumerate(decoded) if isinstance(image, torch.Tensor)]
        if not good:
            raise RunError(
                f"no image of a batch of {len(decoded)} could be decoded on the GPU (e.g. {batch.sources[0]}: "
                f"{decoded[0]}): check the files, or use dataset.decode=cpu"
            )
        labels, skipped = batch.labels, list(batch.skipped)
        if len(good) < len(decoded):
            labels = labels.clone()
            for i, image in enumerate(decoded):
                if isinstance(image, str):
                    skipped.append(f"{batch.sources[i]}: {image}")
                    stand_in = next((j for j in good if j > i), good[0])
                    decoded[i], labels[i] = decoded[stand_in], labels[stand_in]
        images = self._transform(decoded)
        if self.flip_p:
            flip = torch.rand(images.shape[0], device=images.device) < self.flip_p
            images = torch.where(flip[:, None, None, None], images.flip(-1), images)
        return Batch(images, labels.to(device, non_blocking=True), tuple(skipped))

    def _transform(self, images: list[torch.Tensor]) -> torch.Tensor:
        if self.random_crop is not None:
            return self._random_resized_crops(images, self.random_crop)
        if not self.same_for_all:
            return torch.stack([self.per_image(image) for image in images])
        by_size: dict[tuple[int, ...], list[int]] = {}
        for i, image in enumerate(images):
            by_size.setdefault(tuple(image.shape), []).append(i)
        out: list[torch.Tensor | None] = [None] * len(images)
        for indices in by_size.values():
            for i, image in zip(indices, self.per_image(torch.stack([images[i] for i in indices])), strict=True):
                out[i] = image
        return torch.stack(out)

    @staticmethod
    def _random_resized_crops(images: list[torch.Tensor], crop: v2.RandomResizedCrop) -> torch.Tensor:
        """RandomResizedCrop's parameters (the host's generator, as the CPU path), then a crop view and one
        antialiased bilinear interpolate per image; float32 out, in 0..255 like the uint8 batches."""
        out = []
        for image in images:
            top, left, height, width = RandomResizedCropParams.get_params(image, crop.scale, crop.ratio)
            patch = image[None, :, top : top + height, left : left + width].float()
            out.append(F.interpolate(patch, size=list(crop.size), mode="bilinear", antialias=True))
        return torch.cat(out)


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
        indices, seeds = self.sampler.order()  # NumPy: about a millisecond for 50,000 samples
        if not len(indices):
            return
        order, seeds = _to(self.images.device, indices), _to(self.images.device, seeds)
        for start in range(0, len(self) * self.batch_size, self.batch_size):
            index = order[start : start + self.batch_size]
            images = self.images[index]
            if self.augment:
                images = pad_crop_flip(images, seeds[start : start + self.batch_size])
            yield Batch(images, self.labels[index])


def _to(device: torch.device, array: Any) -> torch.Tensor:
    """A host array on `device`; on CUDA through pinned memory, so the copy does not wait for the GPU."""
    tensor = torch.from_numpy(array)
    return tensor.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else tensor


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
