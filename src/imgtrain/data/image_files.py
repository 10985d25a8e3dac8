"""Image files as datasets: each item (uint8 tensor [3, H, W], int label), read and decoded lazily by the workers
(or, dataset.decode=cuda, read as bytes for the GPU to decode), an unreadable file a CorruptSampleError. The
builders make them with `file_bundle` (data/datasets.py) from the paths and labels they list.
"""

from __future__ import annotations

import os
import time
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

from imgtrain.config.datasets import MAX_IMAGE_PIXELS
from imgtrain.data import batched, stages
from imgtrain.data.decoders import DECODE_ERRORS, decode_bytes, error_reason, read_file
from imgtrain.data.jpeg import EncodedJpeg, checked_frame
from imgtrain.data.reads import read_bytes
from imgtrain.data.scaled_decode import Reduced, decode_for_crop

CropDraw = tuple[int | None, batched.CropSpec]  # a sample's seed and its batch's crop: what `decoded` may read less for


class CorruptSampleError(Exception):
    """An image file that cannot be read or decoded: its path and why; the message is "path: reason"."""

    def __init__(self, path: str, reason: str = "") -> None:  # one argument: how DataLoader re-raises it
        super().__init__(f"{path}: {reason}" if reason else path)
        self.path, self.reason = path, reason


class DecodedSamples(Dataset):
    """A dataset whose `decoded(index)` gives (uint8 [3, H, W], label) and records the read and decode stages: an
    item is that image through `transform` (the per-sample path; batched crops call `decoded` alone), its augment
    stage timed. Image files and a user's own Dataset (data/user_datasets.py) share it."""

    transform: Any

    def decoded(self, index: int, crop: CropDraw | None = None) -> tuple[torch.Tensor | Reduced, int]:
        """(image, label); `crop` (seed, CropSpec): the crop the batch will take, which a dataset of files may
        decode fewer pixels for (data/scaled_decode.py)."""
        raise NotImplementedError

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        raw, label = self.decoded(index)
        read, decode, _ = stages.take()
        started = time.perf_counter()
        image = self.transform(raw).contiguous()
        stages.record(read, decode, time.perf_counter() - started)
        return image, label


class ImageFileDataset(DecodedSamples):
    """Lazily decoded image files with integer labels, shared by `shapes`, `imagefolder` and `csv`. A file whose
    header claims more than `max_pixels` pixels (dataset.max_image_pixels; None: no limit) is unreadable."""

    def __init__(
        self,
        paths: list[str],
        labels: list[int],
        classes: list[str],
        transform: Any,
        max_pixels: int | None = MAX_IMAGE_PIXELS,
        scaled: bool = False,
    ) -> None:
        # numpy arrays, not a list of (path, label) tuples: each worker touching refcounted python objects
        # would copy their pages (copy-on-write), multiplying RAM by num_workers + 1. Bytes, not np.str_,
        # which stores 4 bytes per character.
        self.paths = np.array([os.fsencode(p) for p in paths], dtype=np.bytes_)
        self.labels = np.array(labels, dtype=np.int64)
        self.classes = list(classes)
        self.transform = transform
        self.max_pixels = max_pixels
        self.scaled = scaled  # dataset.scaled_decode: JPEGs at 1/2, 1/4 or 1/8 scale where the crop allows

    def __len__(self) -> int:
        return len(self.paths)

    def path(self, index: int) -> str:
        """The file behind item `index`."""
        return os.fsdecode(self.paths[index])

    @property
    def crop_spec(self) -> batched.CropSpec | None:
        """The transform as one call for a whole batch (data/batched.py), or None: then each sample is transformed
        on its own by `__getitem__`."""
        return batched.spec_of(self.transform)

    def decoded(self, index: int, crop: CropDraw | None = None) -> tuple[torch.Tensor | Reduced, int]:
        """Item `index` read and decoded, not transformed: uint8 [3, H, W] and its label (read and decode timed);
        Reduced where scaled decoding is on and `crop` needs fewer pixels."""
        path = self.path(index)
        started = time.perf_counter()
        try:
            data = read_file(path, self.max_pixels)  # a regular file, its size and the cap at most (data/reads.py)
            read = time.perf_counter()
            if self.scaled and crop is not None:
                raw = decode_for_crop(data, path, self.max_pixels, *crop)
            else:
                raw = decode_bytes(data, path, self.max_pixels)
        except DECODE_ERRORS as error:
            raise CorruptSampleError(path, error_reason(error)) from None
        stages.record(read - started, time.perf_counter() - read)
        return raw, int(self.labels[index])


class EncodedFileDataset(ImageFileDataset):
    """JPEG files as undecoded bytes (dataset.decode=cuda): the training process decodes whole batches on the
    GPU and applies `transform` there, so workers only read files (and check their markers and size)."""

    crop_spec = None  # the GPU decodes and transforms whole batches (data/gpu_decode.py)

    def __getitem__(self, index: int) -> tuple[EncodedJpeg, int]:
        path = self.path(index)
        started = time.perf_counter()
        try:
            raw = read_bytes(path, self.max_pixels)  # a regular file, its size and the cap at most (data/reads.py)
        except OSError as error:
            raise CorruptSampleError(path, str(error.strerror or error)) from None
        frame = checked_frame(raw, self.max_pixels)
        if isinstance(frame, str):
            raise CorruptSampleError(path, frame)
        stages.record(read=time.perf_counter() - started)  # decoding is timed on the GPU (gpu_decode)
        data = torch.frombuffer(raw, dtype=torch.uint8)
        return EncodedJpeg(data, path, orientation=frame.orientation), int(self.labels[index])
