"""data.worker_batch_size: each DataLoader worker makes a slice of a step's batch, and the slices are joined into
the step's batch where they arrive: on the device, after each slice's copy.

Why: a worker made a whole batch. With photos of very different sizes (a folder with a few 12-MP photos among
ImageNet-sized files), a batch that drew several of them took ~1.5 s in one worker (H200 box, 2026-11-27), and the
DataLoader, which hands out batches in order and gives a worker new work only as the loop takes a batch, left the
others idle behind it: the workers were 69% busy while the GPU waited. A slice's slow file stalls a slice, which
other workers' slices overtake in the queue, and a step's slow files are decoded by several workers at once.

The slices of a step are consecutive in the sampler's order and each keeps its samples' seeds, so the joined batch
is the batch a whole-batch worker makes (the same crops and flips, the same order: an exact resume), but for an
unreadable file, which is replaced by another image of its slice rather than of its batch.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any, NamedTuple

import torch

from imgtrain.data.jpeg import EncodedBatch
from imgtrain.data.samples import Batch, RawBatch
from imgtrain.data.stages import BatchTimes


def sliced_args(kwargs: dict[str, Any], slices: int) -> dict[str, Any]:
    """The DataLoader's arguments for slices of the plan's batch: as many slices ahead per worker as the plan's
    batches (the same images in flight, the same /dev/shm)."""
    sliced = kwargs | {"batch_size": kwargs["batch_size"] // slices}
    if kwargs.get("prefetch_factor"):
        sliced["prefetch_factor"] = kwargs["prefetch_factor"] * slices
    return sliced


class JoinedImages(NamedTuple):
    """A step's images still in slices: joined by `to` on the device they go to, after each slice's copy (on a GPU
    the join is a device-side copy, not a pass over host memory in the training process)."""

    parts: tuple[Any, ...]  # uint8 tensors [b, 3, H, W], or RawBatches (data.augment_on=device)

    @property
    def device(self) -> torch.device:
        return self.parts[0].device

    def to(self, device: torch.device, non_blocking: bool = False) -> torch.Tensor | RawBatch:
        moved = [part.to(device, non_blocking=non_blocking) for part in self.parts]
        return join_raw(moved) if isinstance(moved[0], RawBatch) else torch.cat(moved)


def join_raw(parts: list[RawBatch]) -> RawBatch:
    """RawBatches of one step as one: their canvases padded to the largest at the top left (each plan's
    coordinates are relative to its image's top left, which stays), plans and erasing boxes stacked."""
    height = max(part.images.shape[-2] for part in parts)
    width = max(part.images.shape[-1] for part in parts)
    count, channels = sum(part.images.shape[0] for part in parts), parts[0].images.shape[1]
    canvas = parts[0].images.new_zeros((count, channels, height, width))
    start = 0
    for part in parts:
        rows, _, h, w = part.images.shape
        canvas[start : start + rows, :, :h, :w].copy_(part.images)
        start += rows
    erase = None if parts[0].erase is None else torch.cat([part.erase for part in parts])
    return parts[0]._replace(images=canvas, plan=torch.cat([part.plan for part in parts]), erase=erase)


def join_encoded(parts: list[EncodedBatch]) -> EncodedBatch:
    """Undecoded JPEGs of one step as one EncodedBatch (dataset.decode=cuda decodes the step's files at once)."""
    turned = any(part.orientations is not None for part in parts)
    orientations = None
    if turned:
        upright = [torch.ones_like(p.lengths) if p.orientations is None else p.orientations for p in parts]
        orientations = torch.cat(upright)
    data = torch.cat([part.data for part in parts])
    return EncodedBatch(data, torch.cat([p.lengths for p in parts]), torch.cat([p.seeds for p in parts]), orientations)


def join_times(times: list[BatchTimes | tuple]) -> BatchTimes | tuple:
    """The slices' stage seconds summed; finished when the last slice was (empty: not timed)."""
    if not all(times):
        return ()
    summed = [sum(values) for values in zip(*times, strict=True)]
    return BatchTimes(*summed)._replace(finished=max(t.finished for t in times))


def join(parts: list[Batch]) -> Batch:
    """One step's batch from its slices, in their order."""
    present = [part for part in parts if part.images is not None]
    first = present[0].images if present else None
    if isinstance(first, EncodedBatch):
        images = join_encoded([part.images for part in present])
    else:
        images = JoinedImages(tuple(part.images for part in present)) if present else None
    return Batch(
        images=images,
        labels=torch.cat([part.labels for part in parts]),
        skipped=tuple(record for part in parts for record in part.skipped),
        sources=tuple(source for part in parts for source in part.sources),
        times=join_times([part.times for part in parts]),
    )


class JoinedSlices:
    """The iterator of a SlicedLoader's epoch: `slices` batches of the DataLoader's joined into one, the last group
    dropped when incomplete with `drop_last`. `inner` is the DataLoader's iterator: its failures are explained, and
    its workers stopped, through it (data/failures.py)."""

    def __init__(self, inner: Iterator[Batch], slices: int, drop_last: bool) -> None:
        self.inner, self.slices, self.drop_last = inner, slices, drop_last

    def __iter__(self) -> JoinedSlices:
        return self

    def __next__(self) -> Batch:
        parts = []
        for part in self.inner:
            parts.append(part)
            if len(parts) == self.slices:
                return join(parts)
        if parts and not self.drop_last:
            return join(parts)
        raise StopIteration

    def __getattr__(self, name: str) -> Any:  # _shutdown_workers, _workers: the DataLoader iterator's
        if name == "inner":  # not set yet (copy, pickle): no recursion
            raise AttributeError(name)
        return getattr(self.inner, name)


class SlicedLoader:
    """A DataLoader whose workers make `slices` slices of each step's batch, seen as the loader of whole steps:
    its length is in steps, its epoch yields joined batches, and everything else (sampler, workers, persistent
    iterator) is the DataLoader's."""

    def __init__(self, loader: Any, slices: int, drop_last: bool) -> None:
        self.loader, self.slices, self.drop_last = loader, slices, drop_last

    def __len__(self) -> int:
        count = len(self.loader) / self.slices
        return math.floor(count) if self.drop_last else math.ceil(count)

    def __iter__(self) -> JoinedSlices:
        return JoinedSlices(iter(self.loader), self.slices, self.drop_last)

    def __getattr__(self, name: str) -> Any:  # sampler, num_workers, _iterator, in_order, ...
        if name == "loader":  # not set yet (copy, pickle): no recursion
            raise AttributeError(name)
        return getattr(self.loader, name)
