"""`dataset=shards`: splits written by `imgtrain-shards`, streamed by LitData from a directory or object storage.

LitData picks the order (whole chunks dealt to the ranks and their workers, shuffled per epoch, samples shuffled
inside each chunk) and fetches and caches the chunks; everything after the read is the folder path's: each
sample is decoded in the worker (`ShardSplit.__getitem__`), the batch cropped, resized and flipped at once by
`collate` (or on the device: data.augment_on), timed stage by stage, each sample with its own augmentation seed,
and an unreadable image is replaced (training) or dropped (validation) and counted. LitData may decode only what
the converter writes (`manifest.FIELDS`), whatever a shard's index asks for (engine.Refused).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from litdata import StreamingDataset
from litdata.streaming.sampler import ChunkedIndex

from imgtrain.common.errors import RunError
from imgtrain.config.datasets import MAX_IMAGE_PIXELS
from imgtrain.config.fields import AugmentOn
from imgtrain.data import batched, decoders
from imgtrain.data.datasets import DatasetBundle, imagenet_transforms, triple
from imgtrain.data.decoders import DECODE_ERRORS, decode_bytes, error_reason
from imgtrain.data.image_files import CorruptSampleError
from imgtrain.data.jpeg import EncodedJpeg, checked_frame
from imgtrain.data.loader import LoaderPlan
from imgtrain.data.samplers import sample_seed
from imgtrain.data.samples import GuardedSamples, Sample, Uncropped, seeded
from imgtrain.data.scaled_decode import decode_for_crop, with_full_size
from imgtrain.data.shards import engine
from imgtrain.data.shards.loader import ShardLoader
from imgtrain.data.shards.manifest import FIELDS, SPLITS, Manifest, check_files, read_manifest
from imgtrain.data.shards.store import Location, Store, redact
from imgtrain.data.streamed import StreamedSplit

log = logging.getLogger(__name__)


class ShardError(RunError):
    """A shard that cannot be read (gone, truncated, damaged): the run stops with one line naming it."""


@dataclass
class Record:
    """One sample as the converter stored it."""

    data: bytes  # the image file's bytes, as they were (or, packed with --max-side, the downscaled JPEG's)
    label: int
    name: str  # <dataset root>:<path under the converted folder>, for messages and the unreadable-files list


class ShardSplit(StreamingDataset, StreamedSplit):
    """One split of a converted dataset. LitData calls `__getitem__` in the worker for each sample of its order;
    this returns the folder path's `loader.Sample`: (image, label, unreadable files met, stage seconds).
    `samples`: how many the converter stored (the manifest's count), whatever LitData deals out; `max_pixels`:
    dataset.max_image_pixels, checked in each image's header before it is decoded (or handed to nvJPEG);
    `scaled`: dataset.scaled_decode (data/scaled_decode.py)."""

    def __init__(
        self,
        location: Location,
        split: str,
        transform: Any,
        *,
        gpu_decode: bool,
        cache: dict,
        samples: int,
        max_pixels: int | None = MAX_IMAGE_PIXELS,
        scaled: bool = False,
    ) -> None:
        url = location.join(split)
        super().__init__(
            input_dir=url,
            cache_dir=cache["dir"],
            max_cache_size=cache["limit"],
            storage_options=engine.storage_options(cache["timeout_s"]),
            serializers=engine.serializers(set(FIELDS.values())),
        )
        self.url, self.root, self.image_transform, self.gpu_decode = url, location.url, transform, gpu_decode
        self.batch_crop = batched.spec_of(transform)  # None: a transform applied per sample (read once, not per one)
        self._samples, self.max_pixels = samples, max_pixels
        self.scaled = scaled  # dataset.scaled_decode: JPEGs at reduced scale where the crop allows
        # Set by ShardLoader before its workers start: training (augmentation seeds, replacing unreadable images)
        # or validation (dropping them), and whether samples are timed (data.stage_timings).
        self.train, self.timed = False, True
        self.augment_on = AugmentOn.workers  # where the batch is cropped: the loader plan's (data.augment_on)
        self._previous: tuple[int, Record] | None = None  # (epoch, the last readable record of this worker)

    def __getitem__(self, index: ChunkedIndex | int) -> Sample | dict:
        if not isinstance(index, ChunkedIndex):  # random access by position: the stored record itself
            return super().__getitem__(index)
        started = time.perf_counter()
        seed = sample_seed(self.seed, self.current_epoch - 1, index.index) if self.train else None
        record = self._read(index)
        read = time.perf_counter() - started
        skipped: list[tuple[str, str]] = []
        stand_ins = self._stand_ins(index)
        while True:
            try:
                image, decode, augment = self._decode(record, seed)
                break
            except CorruptSampleError as error:
                skipped.append((error.path, error.reason))
                if not self.train:  # validation drops it, so no image counts twice in val_acc
                    return None, -1, tuple(skipped), None
                record = next(stand_ins, None)
                if record is None:
                    raise CorruptSampleError(
                        error.path, f"{error.reason} (and no readable image to replace it)"
                    ) from None
        self._previous = (self.current_epoch, record)
        times = (read, decode, augment, time.perf_counter() - started) if self.timed else None
        return image, record.label, tuple(skipped), times

    @property
    def samples(self) -> int:
        """The samples stored in this split. `len()` is LitData's count for the loader's topology instead: with
        drop_last, whole batches per rank only (0 when the split holds fewer than world_size x batch_size)."""
        return self._samples

    def build_loader(
        self,
        plan: LoaderPlan,
        *,
        train: bool,
        seed: int,
        rank: int,
        world_size: int,
        replan: Callable[[int], LoaderPlan] | None = None,
    ) -> ShardLoader:
        return ShardLoader(self, plan, train=train, seed=seed, rank=rank, world_size=world_size, replan=replan)

    def get_len(self, num_workers: int, batch_size: int) -> int:
        try:
            return super().get_len(num_workers, batch_size)
        except Exception as error:  # LitData opening the index to deal the samples (what len() asks)
            raise self._broken(error) from None

    def __iter__(self) -> ShardSplit:
        try:
            return super().__iter__()
        except Exception as error:  # LitData setting up this worker's shards
            raise self._broken(error) from None

    def __next__(self) -> Sample:
        try:
            return super().__next__()
        except (StopIteration, ShardError, CorruptSampleError):
            raise
        except Exception as error:  # LitData opening, mapping or prefetching the next shard
            raise self._broken(error) from None

    def _broken(self, error: Exception, chunk: int | None = None) -> ShardError:
        where = f"chunk {chunk}" if chunk is not None else "a shard"
        return ShardError(  # LitData's and obstore's messages may quote the endpoint URL: shown without credentials
            redact(
                f"{self.url}: {where} cannot be read ({type(error).__name__}: {error_reason(error)}); run "
                "`imgtrain-shards` again or restore the shard, then run the same command"
            )
        )

    def _read(self, index: ChunkedIndex) -> Record:
        try:
            item = super().__getitem__(index)
            return Record(bytes(item["image"]), int(item["label"]), f"{self.root}:{item['path']}")
        except Exception as error:  # LitData's errors, from a missing chunk to a damaged offsets table
            raise self._broken(error, index.chunk_index) from None

    def _stand_ins(self, index: ChunkedIndex) -> Iterator[Record]:
        """What replaces an unreadable training image, in turn: the previous readable one this worker read in this
        epoch (no I/O), then neighbours in the same chunk (already local), at most MAX_IN_A_ROW in all. Under a
        fixed topology this depends only on the order, so a resumed run replaces it the same way, unless the resume
        point falls right before the unreadable image."""
        if self._previous is not None and self._previous[0] == self.current_epoch:
            yield self._previous[1]
        interval = self.cache.get_chunk_intervals()[index.chunk_index]
        first, last = interval[1], interval[2]  # this chunk's samples: [first, last)
        for step in range(1, min(GuardedSamples.MAX_IN_A_ROW, last - first)):
            yield self._read(ChunkedIndex(first + (index.index - first + step) % (last - first), index.chunk_index))

    def _decode(self, record: Record, seed: int | None) -> tuple[Any, float, float]:
        """(image, decode seconds, augment seconds): uint8 [3, S, S], or the undecoded JPEG with decode=cuda."""
        if self.gpu_decode:  # the GPU decodes and transforms whole batches (gpu_decode.py)
            frame = checked_frame(record.data, self.max_pixels)
            if isinstance(frame, str):
                raise CorruptSampleError(record.name, frame)
            data = torch.frombuffer(bytearray(record.data), dtype=torch.uint8)
            return EncodedJpeg(data, record.name, seed, frame.orientation), 0.0, 0.0
        started = time.perf_counter()
        spec = self.batch_crop
        try:
            data = torch.frombuffer(bytearray(record.data), dtype=torch.uint8)
            if self.scaled and spec is not None:
                raw = decode_for_crop(data, record.name, self.max_pixels, seed, spec)
            else:
                raw = decode_bytes(data, record.name, self.max_pixels)
        except DECODE_ERRORS as error:
            raise CorruptSampleError(record.name, error_reason(error)) from None
        decoded = time.perf_counter()
        if spec is not None:  # cropped, resized and flipped with the whole batch by `collate` (data/samples.py)
            image, full = with_full_size(raw)
            return Uncropped(image, seed, spec, self.augment_on, full), decoded - started, 0.0
        transform = self.image_transform
        image = (transform(raw) if seed is None else seeded(seed, transform, raw)).contiguous()
        return image, decoded - started, time.perf_counter() - decoded


def _cache(location: Location, split: str, cache_dir: str, limit_gb: float | None, timeout_s: float) -> dict:
    """Where LitData keeps the chunks it fetches from object storage (none for a directory: read in place)."""
    folder = None
    if location.is_s3:
        folder = os.path.join(os.path.expanduser(cache_dir), location.bucket, location.prefix, split)
    return {"dir": folder, "limit": None if limit_gb is None else f"{limit_gb}GB", "timeout_s": timeout_s}


def build_shards(
    name: str,
    image_size: int,
    mean: Any,
    std: Any,
    augment: str | bool,
    root: str,
    val_resize: int | None,
    decode: str,
    cache_dir: str,
    cache_limit_gb: float | None,
    timeout_s: float,
    randaugment_ops: int = 2,
    randaugment_magnitude: int = 9,
    random_erasing: float = 0.0,
    val_image_size: int | None = None,
    max_image_pixels: int | None = MAX_IMAGE_PIXELS,
    scaled_decode: bool = False,
    gpu_decoder: str | None = None,  # with decode=cuda, the feed's choice (data/region_decode.py), not the split's
) -> DatasetBundle:
    """The converted dataset at `root`, checked before any step: the store answers, the manifest is there and every
    shard has the size the converter wrote (one line naming what is wrong otherwise)."""
    if str(decode) != "cuda":  # nvJPEG decodes on the GPU: no CPU decoder needed
        decoders.check(f"dataset={name}", alternative="use dataset.decode=cuda on a GPU")
    location = Location.parse(root)
    store = Store(location, timeout_s)
    store.check_reachable()
    manifest: Manifest = read_manifest(store)
    for split in SPLITS:
        check_files(store, manifest, split)
    log.info("dataset.root=%s: %s", location.url, manifest.packed())  # e.g. at --max-side 512: what training sees
    chosen = imagenet_transforms(
        image_size,
        val_resize,
        augment,
        randaugment_ops=randaugment_ops,
        randaugment_magnitude=randaugment_magnitude,
        random_erasing=random_erasing,
        mean=mean,
        val_image_size=val_image_size,
    )
    transforms = dict(zip(SPLITS, chosen, strict=True))
    train, val = (
        ShardSplit(
            location,
            split,
            transforms[split],
            gpu_decode=str(decode) == "cuda",
            cache=_cache(location, split, cache_dir, cache_limit_gb, timeout_s),
            samples=manifest.splits[split].samples,
            max_pixels=max_image_pixels,
            scaled=scaled_decode,
        )
        for split in SPLITS
    )
    classes = list(manifest.classes)
    return DatasetBundle(train, val, len(classes), image_size, triple(mean), triple(std), name, classes)
