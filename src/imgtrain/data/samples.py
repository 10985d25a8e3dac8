"""Samples and batches: what a Dataset item becomes on its way to the loop.

`GuardedSamples` wraps a Dataset: it seeds each sample's augmentation, handles unreadable files (replaced in
training, dropped in validation) and, when the DataLoader asks for a whole batch (`__getitems__`), decodes each
sample on its own and leaves it Uncropped. `collate` crops, resizes and flips the batch in one call
(data/batched.py), each crop written once into the batch it hands over (channels-last; in shared memory inside a
worker), then runs the policy per sample and random erasing on the stacked batch (data/policies.py), or leaves the
crop and erasing to the device (RawBatch, data/resample.py), and makes the `Batch` the loop receives, with the
unreadable files and the stage times (all of it the `augment` stage's).
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from typing import Any, NamedTuple

import numpy as np
import torch
from torch.utils.data import Dataset, default_collate, get_worker_info

from imgtrain.config.fields import AugmentOn
from imgtrain.data import batched, policies, resample, stages
from imgtrain.data.image_files import CorruptSampleError
from imgtrain.data.jpeg import EncodedBatch, EncodedJpeg
from imgtrain.data.policies import seeded
from imgtrain.data.scaled_decode import Reduced, with_full_size

# data.augment_on=auto: a batch of one image size goes to the device uncropped when its images hold at most this
# many times the pixels of the crops: up to 2x the crops' bytes through shared memory, pinning and PCIe, for a
# worker freed of the crop and resize (1.3x the images per busy worker core at 32 px; BENCHMARKS.md, 2026-11-24
# 22:25). A rule until a GPU run compares the two places (bench.py's r18_dataloader rows).
DEVICE_AUGMENT_MAX_AREA = 2.0
# data.augment_on=device: a batch whose canvas of windows (data/resample.py) would exceed this is cropped in the
# worker instead. The canvas is padded to the batch's largest window, so one 4000x3000 photo among 255 ImageNet
# images would ship 4.4 GB through shared memory, pinning and PCIe (BENCHMARKS.md, 2026-11-25); 256 ImageNet-sized
# images' training windows take 173 MB. The bound is the device's chunk: at most one chunk per batch there.
DEVICE_CANVAS_MAX_BYTES = resample.CHUNK_BYTES


class Batch(NamedTuple):
    """What the loaders yield: uint8 images [B, 3, H, W] (channels-last in memory from the batched crops), labels
    [B], and the unreadable files replaced (training)
    or dropped (validation: then B may be smaller than the batch size, even 0, with `images` None).

    With dataset.decode=cuda, `images` is an EncodedBatch (the undecoded JPEGs in one byte buffer, with their seeds)
    and `sources` their paths. With data.augment_on=device, a RawBatch (decoded, not yet cropped).
    """

    images: Any
    labels: torch.Tensor
    skipped: tuple[tuple[str, str], ...] = ()  # (path, reason) of each unreadable file replaced or dropped
    sources: tuple[str, ...] = ()
    times: stages.BatchTimes | tuple = ()  # the batch's stage seconds (empty with data.stage_timings=false)


class Uncropped(NamedTuple):
    """A decoded image whose crop, resize and flip `collate` does for the whole batch: in the worker, or by the
    device (data.augment_on), with the draws from `seed` (None: a transform without randomness)."""

    image: torch.Tensor
    seed: int | None
    spec: batched.CropSpec
    augment_on: AugmentOn
    full: tuple[int, int] | None = None  # (height, width) at full scale, where decoded smaller (scaled_decode.py)


class RawImage(NamedTuple):
    """A decoded image left uncropped for the device (data.augment_on=device): uint8 [3, H, W], and its crop,
    resize and flip as one plan row (data/resample.py)."""

    image: torch.Tensor
    plan: np.ndarray
    size: int


class RawBatch(NamedTuple):
    """A batch of RawImages: uint8 [B, 3, H, W] (each image cut to the window its plan reaches, padded to the
    batch's largest at the top left: resample.window_canvas), the plans [B, 11] and the output side; with random
    erasing, each crop's box [B, 4] (top, left, height, width; 0 x 0: none) and the fill in uint8 levels, drawn in
    the worker from the seeds (data/policies.py). It moves like a tensor (`to`, `record_stream`); `resampled` crops
    (and erases) it there."""

    images: torch.Tensor
    plan: torch.Tensor
    size: int
    erase: torch.Tensor | None = None
    fill: tuple[float, ...] = ()

    @property
    def device(self) -> torch.device:
        return self.images.device

    def to(self, device: torch.device, non_blocking: bool = False) -> RawBatch:
        images = self.images.to(device, non_blocking=non_blocking)
        erase = None if self.erase is None else self.erase.to(device, non_blocking=non_blocking)
        return self._replace(images=images, plan=self.plan.to(device, non_blocking=non_blocking), erase=erase)

    def record_stream(self, stream: Any) -> None:
        """Every tensor: `resampled` reads them on `stream` too, so no block may be reused before then."""
        for tensor in (self.images, self.plan, self.erase):
            if tensor is not None:
                tensor.record_stream(stream)

    def resampled(self) -> torch.Tensor:
        """Float [B, 3, size, size] in 0..255, on the images' device (two batched matmuls a chunk of
        resample.CHUNK_BYTES at a time, data/resample.py), then erased where the boxes say: the workers' pixels
        there (the same boxes, the same fill)."""
        out = resample.resample(self.images, self.plan, self.size)
        return out if self.erase is None else policies.erase(out, self.erase, self.fill)


Sample = tuple[Any, int, tuple[tuple[str, str], ...], tuple[float, float, float, float] | None]


class Erasing(NamedTuple):
    """A batch's random erasing (data/policies.py): a box per item [len(items), 4] (0 x 0: none), the fill."""

    boxes: np.ndarray
    fill: tuple[float, ...]


def collate(items: list[Sample]) -> Batch:
    """The batch of images and labels (in shared memory inside a worker, as default_collate's), plus the skips and
    the stage times.

    Uncropped images are cropped, resized and flipped here for the whole batch, into the batch itself (and through
    their policy, then stacked), or left for the device (RawBatch); random erasing is one masked fill of the
    stacked batch here, or travels with the RawBatch. Undecoded files (EncodedJpeg, dataset.decode=cuda) are packed
    into one EncodedBatch, with their paths. Items GuardedSamples dropped (image None) are left out.
    """
    items, erasing, stacked = augmented(items)
    started = time.perf_counter()
    skipped = tuple(record for _, _, records, _ in items for record in records)
    present = [i for i, item in enumerate(items) if item[0] is not None]
    kept = [items[i][:2] for i in present]
    boxes = None if erasing is None else torch.from_numpy(erasing.boxes[present])
    erased = 0.0  # seconds of the masked fill: the augment stage's, not collate's
    if not kept:
        batch = Batch(None, torch.empty(0, dtype=torch.long), skipped)
    elif isinstance(kept[0][0], RawImage):
        # Each image cut to what its plan reaches: a smaller canvas through shared memory, pinning and PCIe
        size, plans = kept[0][0].size, np.stack([raw.plan for raw, _ in kept])
        images, plans = resample.window_canvas([raw.image for raw, _ in kept], plans, size)
        raw = RawBatch(images, torch.from_numpy(plans), size, boxes, erasing.fill if erasing is not None else ())
        batch = Batch(raw, torch.tensor([label for _, label in kept]), skipped)
    elif isinstance(kept[0][0], EncodedJpeg):
        labels = torch.tensor([label for _, label in kept])
        files = [e for e, _ in kept]
        packed = EncodedBatch.pack([e.data for e in files], [e.seed for e in files], [e.orientation for e in files])
        batch = Batch(packed, labels, skipped, tuple(e.path for e in files))
    else:
        if stacked is not None and len(stacked) == len(kept):  # the crops, written into the batch already
            images, labels = stacked, torch.tensor([label for _, label in kept])
        else:
            images, labels = _stacked(kept)
        if boxes is not None:  # in place, in shared memory: no copy of the batch
            erasing_started = time.perf_counter()
            policies.erase(images, boxes, erasing.fill)
            erased = time.perf_counter() - erasing_started
        batch = Batch(images, labels, skipped)
    timed = [times for *_, times in items if times is not None]
    if erased and timed:
        share = erased / len(timed)
        timed = [(read, decode, augment + share, total + share) for read, decode, augment, total in timed]
    return batch._replace(times=stages.batch_times(timed, started + erased)) if timed else batch


def _stacked(kept: list[tuple[torch.Tensor, int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """default_collate's images [B, C, H, W] and labels (stacked into shared memory inside a worker), the images in
    the layout they have: channels-last crops (data/batched.py) are stacked as rows [B, H, W, C] and viewed as
    [B, C, H, W], a copy of whole rows where stacking them planar would transpose every pixel. The feed converts to
    the model's memory format on the device (data/feed.py), channels-last on CUDA by default."""
    first = kept[0][0]
    if first.ndim != 3 or first.shape[0] == 1 or first.stride(0) != 1:
        return default_collate(kept)
    rows, labels = default_collate([(image.permute(1, 2, 0), label) for image, label in kept])
    return rows.permute(0, 3, 1, 2), labels


def augmented(items: list[Sample]) -> tuple[list[Sample], Erasing | None, torch.Tensor | None]:
    """The batch's Uncropped images cropped, resized and flipped in one call, then through their policy
    (data/batched.py), or as RawImages with their plans when the device is to do it; their random erasing's
    boxes, drawn from the seeds (None: nothing to erase); and, without a policy, the crops as the batch itself
    [B, 3, S, S], written there by the crop (in shared memory inside a worker, as default_collate's batches), else
    None. The time is split evenly over the images' augment stage."""
    kept = [i for i, item in enumerate(items) if isinstance(item[0], Uncropped)]
    if not kept:
        return items, None, None
    started = time.perf_counter()
    uncropped: list[Uncropped] = [items[i][0] for i in kept]
    images, spec = [u.image for u in uncropped], uncropped[0].spec
    seeds = None if uncropped[0].seed is None else np.array([u.seed for u in uncropped], dtype=np.int64)
    full = _full_sizes(uncropped)
    plans = (
        resample.plan_batch(*resample.sizes_of(images), seeds, spec, full)
        if _on_device(images, spec, uncropped[0].augment_on)
        else None
    )
    stacked = None
    if plans is not None and resample.window_canvas_bytes(images, plans, spec.size) <= DEVICE_CANVAS_MAX_BYTES:
        images = [RawImage(image, plan, spec.size) for image, plan in zip(images, plans, strict=True)]
    elif spec.policy:  # the policy runs per sample, on the crops: collate stacks what it gives
        images = batched.augment_batch(images, seeds, spec, full)
    else:  # the workers' place, or a batch whose canvas for the device would be too large (one huge photo)
        shared = get_worker_info() is not None  # as default_collate's batches
        stacked = batched.crop_batch(
            images, seeds, spec, full, batched.channels_last_batch(len(images), spec.size, images[0], shared)
        )
        images = list(stacked)
    erasing = _erasing(seeds, spec, kept, len(items))
    share = (time.perf_counter() - started) / len(kept)
    items = list(items)
    for image, i in zip(images, kept, strict=True):
        _, label, skipped, times = items[i]
        if times is not None:
            times = (times[0], times[1], times[2] + share, times[3] + share)
        items[i] = (image, label, skipped, times)
    return items, erasing, stacked


def _full_sizes(uncropped: list[Uncropped]) -> np.ndarray | None:
    """[B, 2] (height, width) at full scale of a batch with an image decoded smaller (each other image's own
    size); None when every image is at full scale."""
    if all(u.full is None for u in uncropped):
        return None
    return np.array([u.full or tuple(u.image.shape[-2:]) for u in uncropped], dtype=np.int64)


def _erasing(seeds: np.ndarray | None, spec: batched.CropSpec, kept: list[int], count: int) -> Erasing | None:
    """The erasing boxes of the batch's `count` items, those of the `kept` ones drawn from their seeds."""
    if spec.erasing is None or seeds is None:
        return None
    drawn = policies.erase_boxes(seeds, spec.erasing, spec.size)
    if not drawn[:, 2].any():
        return None  # no image of this batch is erased
    boxes = np.zeros((count, 4), dtype=np.int64)
    boxes[kept] = drawn
    return Erasing(boxes, spec.erasing.fill)


def _on_device(images: list[torch.Tensor], spec: batched.CropSpec, augment_on: AugmentOn) -> bool:
    """data.augment_on for this batch: auto sends it uncropped when its images share one size near the crop's. A
    policy needs the crop (validate refuses augment_on=device with one): the workers crop."""
    if spec.policy:
        return False
    if augment_on != AugmentOn.auto:
        return augment_on == AugmentOn.device
    height, width = images[0].shape[-2:]
    one_size = all(image.shape == images[0].shape for image in images)
    return one_size and height * width <= DEVICE_AUGMENT_MAX_AREA * spec.size**2


class GuardedSamples(Dataset):
    """Wraps a dataset: seeds augmentation per sample, and handles an unreadable image.

    Training (`replace`) takes the next readable image instead: every batch keeps its shape, which
    BatchNorm, DDP and torch.compile prefer. Validation drops it (image None), so no image is counted twice
    in val_acc. Either way the file is reported with the batch and counted against data.max_bad_samples.
    """

    MAX_IN_A_ROW = 16  # more consecutive unreadable files than this is a broken dataset, not a bad file

    def __init__(
        self,
        dataset: Dataset,
        replace: bool = True,
        timed: bool = True,
        augment_on: AugmentOn = AugmentOn.workers,
        seeded_loads: bool = True,
    ) -> None:
        self.dataset, self.replace, self.timed, self.augment_on = dataset, replace, timed, augment_on
        # A per-sample dataset's own draws (a user's Dataset, a transform that is not the batched crop) from torch's
        # generator set to the sample's seed. Off on loader threads: that generator is the process's one, and
        # seeding it under a lock would run one such sample at a time (docs/input-pipeline.md, data.engine)
        self.seeded_loads = seeded_loads

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, item: int | tuple[int, int]) -> Sample:
        """(image, label, the unreadable files met, (read, decode, augment, total) seconds or None). An undecoded
        JPEG (dataset.decode=cuda) carries the sample's seed: the GPU side draws its crop and flip from it."""
        image, *rest = self._guarded(item, self._load)
        if isinstance(image, EncodedJpeg) and image.seed is None and isinstance(item, tuple):
            image = image._replace(seed=item[1])
        return (image, *rest)

    def __getitems__(self, items: list[int | tuple[int, int]]) -> list[Sample]:
        """A batch's samples (the DataLoader asks for a batch at once): each read and decoded on its own and, when
        the dataset's transform allows it, left Uncropped for `collate` to crop, resize and flip as one batch
        (or the device, data.augment_on), each with its seed; otherwise each sample as `__getitem__` gives it.
        In-memory datasets give the whole batch at once (`batch_items`)."""
        if getattr(self.dataset, "batchable", False):
            indices, seeds = [_index_of(item) for item in items], [_seed_of(item) for item in items]
            return self.dataset.batch_items(indices, seeds, self.timed)
        spec = getattr(self.dataset, "crop_spec", None)
        if spec is None:
            return [self[item] for item in items]
        decoded = functools.partial(self._decoded, spec=spec)
        samples = [self._guarded((_index_of(item), _seed_of(item)), decoded) for item in items]
        for i, (image, label, skipped, times) in enumerate(samples):
            if image is not None:  # cropped, resized and flipped with the whole batch by `collate`
                image, full = with_full_size(image)
                samples[i] = (Uncropped(image, _seed_of(items[i]), spec, self.augment_on, full), label, skipped, times)
        return samples

    def _guarded(self, item: int | tuple[int, int], load: Callable[[int, int | None], Any]) -> Sample:
        """`load(index, seed)` as a Sample; an unreadable file is replaced by the next one, or dropped."""
        index, seed = item if isinstance(item, tuple) else (item, None)
        skipped: list[tuple[str, str]] = []
        for _ in range(self.MAX_IN_A_ROW):
            try:
                if not self.timed:
                    return (*load(index, seed), tuple(skipped), None)
                (image, label), times = stages.timed_sample(load, index, seed)
                return image, label, tuple(skipped), times
            except CorruptSampleError as error:
                skipped.append((error.path, error.reason))
                if not self.replace:
                    return None, -1, tuple(skipped), None
                index = (index + 1) % len(self.dataset)
        path, reason = skipped[-1]
        raise CorruptSampleError(path, f"{reason} ({self.MAX_IN_A_ROW} unreadable images in a row)")

    def _load(self, index: int, seed: int | None) -> tuple[torch.Tensor, int]:
        if seed is None or not self.seeded_loads:
            return self.dataset[index]
        return seeded(seed, self.dataset.__getitem__, index)

    def _decoded(self, index: int, seed: int | None, spec: batched.CropSpec) -> tuple[torch.Tensor | Reduced, int]:
        """Decoded for the batch's crop (`spec`, its box from `seed`): at reduced scale where the dataset does that
        and the crop allows."""
        return self.dataset.decoded(index, (seed, spec))


def _index_of(item: int | tuple[int, int | None]) -> int:
    return item[0] if isinstance(item, tuple) else item


def _seed_of(item: int | tuple[int, int | None]) -> int:
    """A sample's augmentation seed: the sampler's, or its index where the sampler gives none (validation)."""
    index, seed = item if isinstance(item, tuple) else (item, None)
    return index if seed is None else seed
