"""Samples and batches: what a Dataset item becomes on its way to the loop.

`GuardedSamples` wraps a Dataset: it seeds each sample's augmentation, handles unreadable files (replaced in
training, dropped in validation) and, when the DataLoader asks for a whole batch (`__getitems__`), decodes each
sample on its own and augments the batch in one call (data/batched.py). `collate` makes the `Batch` the loop
receives, with the unreadable files and the stage times.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, NamedTuple

import numpy as np
import torch
from torch.utils.data import Dataset, default_collate, get_worker_info

from imgtrain.data import batched, stages
from imgtrain.data.datasets import CorruptSampleError
from imgtrain.data.jpeg import EncodedBatch, EncodedJpeg


class Batch(NamedTuple):
    """What the loaders yield: uint8 images [B, 3, H, W], labels [B], and the unreadable files replaced (training)
    or dropped (validation: then B may be smaller than the batch size, even 0, with `images` None).

    With dataset.decode=cuda, `images` is an EncodedBatch (the undecoded JPEGs in one byte buffer, with their seeds)
    and `sources` their paths.
    """

    images: Any
    labels: torch.Tensor
    skipped: tuple[tuple[str, str], ...] = ()  # (path, reason) of each unreadable file replaced or dropped
    sources: tuple[str, ...] = ()
    times: stages.BatchTimes | tuple = ()  # the batch's stage seconds (empty with data.stage_timings=false)


Sample = tuple[Any, int, tuple[tuple[str, str], ...], tuple[float, float, float, float] | None]


def collate(items: list[Sample]) -> Batch:
    """default_collate for images and labels (it stacks into shared memory inside a worker), plus the skips and
    the stage times.

    Undecoded files (EncodedJpeg, dataset.decode=cuda) are packed into one EncodedBatch, with their paths. Items
    GuardedSamples dropped (image None) are left out.
    """
    started = time.perf_counter()
    skipped = tuple(record for _, _, records, _ in items for record in records)
    kept = [(image, label) for image, label, _, _ in items if image is not None]
    if not kept:
        batch = Batch(None, torch.empty(0, dtype=torch.long), skipped)
    elif isinstance(kept[0][0], EncodedJpeg):
        labels = torch.tensor([label for _, label in kept])
        packed = EncodedBatch.pack([e.data for e, _ in kept], [e.seed for e, _ in kept])
        batch = Batch(packed, labels, skipped, tuple(e.path for e, _ in kept))
    else:
        images, labels = default_collate(kept)
        batch = Batch(images, labels, skipped)
    timed = [times for *_, times in items if times is not None]
    return batch._replace(times=stages.batch_times(timed, started)) if timed else batch


class GuardedSamples(Dataset):
    """Wraps a dataset: seeds augmentation per sample, and handles an unreadable image.

    Training (`replace`) takes the next readable image instead: every batch keeps its shape, which
    BatchNorm, DDP and torch.compile prefer. Validation drops it (image None), so no image is counted twice
    in val_acc. Either way the file is reported with the batch and counted against data.max_bad_samples.
    """

    MAX_IN_A_ROW = 16  # more consecutive unreadable files than this is a broken dataset, not a bad file

    def __init__(self, dataset: Dataset, replace: bool = True, timed: bool = True) -> None:
        self.dataset, self.replace, self.timed = dataset, replace, timed

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
        """A batch's samples (the DataLoader asks for a batch at once): each read and decoded on its own, then all
        cropped, resized and flipped in one call (data/batched.py) when the dataset's transform allows it, with
        each sample's draws from its seed; otherwise each sample as `__getitem__` gives it."""
        spec = getattr(self.dataset, "crop_spec", None)
        if spec is None:
            return [self[item] for item in items]
        samples = [self._guarded(item, self._decoded) for item in items]
        kept = [i for i, sample in enumerate(samples) if sample[0] is not None]
        if not kept:
            return samples
        started = time.perf_counter()
        seeds = np.array([_seed_of(items[i]) for i in kept], dtype=np.int64)
        images = batched.augment_batch([samples[i][0] for i in kept], seeds, spec)
        share = (time.perf_counter() - started) / len(kept)  # the batch's augment time, split evenly
        for row, i in enumerate(kept):
            _, label, skipped, times = samples[i]
            if times is not None:
                times = (times[0], times[1], times[2] + share, times[3] + share)
            samples[i] = (images[row], label, skipped, times)
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
        return self.dataset[index] if seed is None else seeded(seed, self.dataset.__getitem__, index)

    def _decoded(self, index: int, seed: int | None) -> tuple[torch.Tensor, int]:
        return self.dataset.decoded(index)


def _seed_of(item: int | tuple[int, int | None]) -> int:
    """A sample's augmentation seed: the sampler's, or its index where the sampler gives none (validation)."""
    index, seed = item if isinstance(item, tuple) else (item, None)
    return index if seed is None else seed


def seeded(seed: int, call: Callable[..., Any], *args: Any) -> Any:
    """`call(*args)` with torch's default CPU generator (which torchvision's random transforms draw from) set to
    `seed`. Seeding only that one: torch.manual_seed would also queue a CUDA re-seed and format a stack trace, ~90 us
    per call. In the training process (num_workers=0) its own random stream is left untouched."""
    if get_worker_info() is None:
        with torch.random.fork_rng(devices=[]):
            torch.random.default_generator.manual_seed(seed)
            return call(*args)
    torch.random.default_generator.manual_seed(seed)
    return call(*args)
