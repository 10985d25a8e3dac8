"""dataset.gpu_decoder=nvimgcodec: each sample's crop region decoded, not its whole image, then the batch resized in
two matmuls (data/resample.py).

The sampler's box depends on the image's size and the sample's seed alone (data/batched.py), and a JPEG's header
gives the size before anything is decoded: so each sample's plan is made from the headers, its window (the pixels
its weights reach: the training box, the validation centre crop's rows and columns) is the region decoded, and the
windows are resampled with the plan moved onto them, the weights the same numbers as on the whole image.
RandomResizedCrop's boxes take 8% to 100% of an image (about half on average): the pixels outside are neither
transformed nor colour-converted nor written, though the entropy-coded data up to the region's last row is still
read (a JPEG's blocks are coded one after another).

Per batch on the host: a header read per file (nvImageCodec's, in C++), the plans and regions in NumPy, one
batched decode call, then the resample's few calls: no host sync per image, no kernel per image but a canvas copy
(and the turn of an EXIF-rotated file). EXIF orientation: each region is asked for in the stored image's pixels
(`stored_regions`) and turned upright after, as the other GPU path turns its images, the same on every backend.
What a backend refuses goes to the next (the hardware engine's refusals to the CUDA decoder, then libjpeg-turbo),
a region it fails is decoded whole and cropped, a file nvImageCodec fails entirely goes to torchvision's decoder,
and only then is it unreadable (counted against data.max_bad_samples as on every path). The workers have already
checked each file's markers, channels (CMYK/YCCK are refused) and dataset.max_image_pixels (jpeg.checked_frame).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from imgtrain.config.datasets import GpuDecoder
from imgtrain.data import batched, codec_engine, region_probe, resample
from imgtrain.data.codec_engine import CodecDecoder
from imgtrain.data.copies import to_device
from imgtrain.data.decoders import upright
from imgtrain.data.gpu_decode import JpegBatchDecoder, decode_jpegs, readable_selection
from imgtrain.data.jpeg import EncodedBatch
from imgtrain.data.samples import Batch

log = logging.getLogger(__name__)

Decoded = list[torch.Tensor | str]  # per file: uint8 [3, h, w] on the device, or why it could not be decoded


def batch_decoder(choice: GpuDecoder, transform: Any, drop: bool) -> Callable[[Batch, torch.device], Batch]:
    """The decoder dataset.gpu_decoder names, for a split's `transform` (`drop`: validation leaves unreadable
    files out)."""
    if choice == GpuDecoder.nvimgcodec:
        return RegionBatchDecoder(transform, drop=drop)
    return JpegBatchDecoder(transform, drop=drop)


def stored_regions(bounds: np.ndarray, orientations: np.ndarray, stored: np.ndarray) -> np.ndarray:
    """Boxes [B, 4] (top, bottom, left, right; bottom and right exclusive) in the upright images, as the same pixels
    in the stored ones [B, 2] (height, width) that EXIF `orientations` [B] turn upright: orientations 5-8 swap the
    axes; 3, 4, 6 and 7 mirror the stored rows, 2, 3, 7 and 8 its columns (decoders.upright's turns, undone)."""
    swap = orientations >= 5
    rows = np.where(swap[:, None], bounds[:, 2:4], bounds[:, 0:2])
    cols = np.where(swap[:, None], bounds[:, 0:2], bounds[:, 2:4])
    mirror_rows, mirror_cols = np.isin(orientations, (3, 4, 6, 7)), np.isin(orientations, (2, 3, 7, 8))
    rows = np.where(mirror_rows[:, None], stored[:, :1] - rows[:, ::-1], rows)
    cols = np.where(mirror_cols[:, None], stored[:, 1:] - cols[:, ::-1], cols)
    return np.concatenate([rows, cols], axis=1)


def upright_sizes(stored: np.ndarray, orientations: np.ndarray) -> np.ndarray:
    """[B, 2] (height, width) once turned upright: EXIF orientations 5-8 swap the sides."""
    return np.where((orientations >= 5)[:, None], stored[:, ::-1], stored)


class RegionBatchDecoder:
    """Decode a Batch of undecoded JPEGs by region with nvImageCodec, then apply the split's transform: the crop
    plans from the headers and seeds, the regions decoded, the batch resampled. Any other transform than
    data/datasets.py's: whole images, then the transform per image. Unreadable files as JpegBatchDecoder treats
    them, but a training sample's replacement is another sample's output (its region was cut for its own box)."""

    def __init__(self, transform: Any, drop: bool = False, backends: tuple[str, ...] | None = None) -> None:
        self.drop = drop
        self.spec = batched.spec_of(transform)
        self.per_image = transform
        self.backends = backends
        self.engine: CodecDecoder | None = None  # made in the decode thread, on its first batch
        self.compared = False  # the first batch's regions checked against its full decode

    def __call__(self, batch: Batch, device: torch.device) -> Batch:
        """`batch` decoded and transformed on `device` (JpegBatchDecoder's contract)."""
        if batch.images is None:  # validation: the workers rejected every file of this batch
            return batch._replace(labels=to_device(batch.labels, device))
        if self.engine is None or self.engine.device != device:
            self.engine = CodecDecoder(device, self.backends)
        encoded: EncodedBatch = batch.images
        files = encoded.files()
        streams = self.engine.streams(files)
        orientations = np.ones(encoded.count, dtype=np.int64)
        if encoded.orientations is not None:
            orientations = encoded.orientations.numpy()
        stored = np.array([(1, 1) if isinstance(s, str) else (s.height, s.width) for s in streams], dtype=np.int64)
        sizes = upright_sizes(stored, orientations)
        seeds = encoded.seeds.numpy()
        plan = None  # any other transform: whole images, transformed one by one
        bounds = np.stack([np.zeros_like(sizes[:, 0]), sizes[:, 0], np.zeros_like(sizes[:, 1]), sizes[:, 1]], 1)
        if self.spec is not None:
            plan = resample.plan_batch(sizes[:, 0], sizes[:, 1], seeds, self.spec)
            bounds, plan = resample.plan_in_windows(plan, self.spec.size)
        regions = stored_regions(bounds, orientations, stored)
        decoded = self._decoded(files, streams, regions, whole=self.spec is None)
        turns = zip(decoded, orientations.tolist(), strict=True)  # as stored: each turned upright now
        decoded = [upright(d, o) if isinstance(d, torch.Tensor) and o != 1 else d for d, o in turns]
        failed = tuple((batch.sources[i], why) for i, why in enumerate(decoded) if isinstance(why, str))
        take, _ = readable_selection(decoded, batch.sources, self.drop)
        labels = batch.labels if not failed else batch.labels[torch.as_tensor(take, dtype=torch.long)]
        return batch._replace(
            images=self._transform(decoded, plan, take) if take else None,
            labels=to_device(labels, device),
            skipped=batch.skipped + failed,
            sources=tuple(batch.sources[i] for i in take),
        )

    def _transform(self, decoded: Decoded, plan: np.ndarray | None, take: list[int]) -> torch.Tensor:
        """The outputs `take` names, float 0..255 (per-image transforms: as they give them): the readable images
        resampled once each, a replaced sample given its replacement's output."""
        readable = sorted(set(take))
        images = [decoded[i] for i in readable]
        if plan is None:
            out = torch.stack([self.per_image(image) for image in images])
        else:
            out = resample.resample_images(images, plan[readable], self.spec.size)
        if len(readable) == len(take):
            return out
        slot = {i: k for k, i in enumerate(readable)}
        return out[torch.tensor([slot[i] for i in take], device=out.device)]

    def _decoded(self, files: list[torch.Tensor], streams: list[Any], regions: np.ndarray, whole: bool) -> Decoded:
        """Each file's region, as stored: by region where this process allows it, else (and for what a region decode
        fails) decoded whole and cropped; what nvImageCodec fails entirely, by torchvision's decoder."""
        out: list[Any] = [s if isinstance(s, str) else None for s in streams]
        todo = [i for i, s in enumerate(streams) if not isinstance(s, str)]
        engine = self.engine
        if todo and not whole and codec_engine.regions_allowed(engine):
            parts = self._regions(engine, [streams[i] for i in todo], regions[todo])
            for i, part in zip(todo, parts, strict=True):
                out[i] = part
            todo = [i for i in todo if out[i] is None]
        if todo:
            for i, image in zip(todo, _decode_whole(engine, [streams[i] for i in todo]), strict=True):
                out[i] = None if image is None else _crop(image, regions[i])
            todo = [i for i in todo if out[i] is None]
        if todo:  # torchvision's decoder, on the same device (nvJPEG on a GPU, libjpeg-turbo on the host)
            for i, image in zip(todo, decode_jpegs([files[i] for i in todo], engine.device), strict=True):
                out[i] = _crop(image, regions[i]) if isinstance(image, torch.Tensor) else image
        return out

    def _regions(self, engine: CodecDecoder, streams: list[Any], regions: np.ndarray) -> list[torch.Tensor | None]:
        """The regions in one call; on this process's first batch, compared with the whole images' crops (the
        probe's files may not be every kind the dataset has): any difference turns region decoding off."""
        try:
            parts = engine.decode(streams, regions)
        except RuntimeError as error:  # the whole call failed (nvImageCodec#55's INTERNAL_ERROR)
            codec_engine.refuse_regions(engine, f"a batch's region decode failed: {str(error).strip()[:120]}")
            return [None] * len(streams)
        if self.compared:
            return parts
        self.compared = True
        wholes = _decode_whole(engine, streams)
        crops = [None if w is None else _crop(w, r) for w, r in zip(wholes, regions, strict=True)]
        worst = region_difference(parts, crops)
        if worst > region_probe.REGION_TOLERANCE:
            codec_engine.refuse_regions(engine, f"the first batch's regions differ by up to {worst:g} levels")
            return [None if image is None else _crop(image, r) for image, r in zip(wholes, regions, strict=True)]
        return parts


def _decode_whole(engine: CodecDecoder, streams: list[Any]) -> list[torch.Tensor | None]:
    """Whole images in one call; a call that fails as a whole, file by file (None for each that fails)."""
    try:
        return engine.decode(streams)
    except RuntimeError:
        out = []
        for stream in streams:
            try:
                out.append(engine.decode([stream])[0])
            except RuntimeError:
                out.append(None)
        return out


def region_difference(parts: list[torch.Tensor | None], crops: list[torch.Tensor | None]) -> float:
    """The largest difference in levels between region decodes and the full decodes' crops (inf for a shape that
    differs), over the pairs both decoded: one host sync for the batch."""
    pairs = [(p, c) for p, c in zip(parts, crops, strict=True) if p is not None and c is not None]
    if any(p.shape != c.shape for p, c in pairs):
        return float("inf")
    if not pairs:
        return 0.0
    return float(torch.stack([(p.short() - c.short()).abs().amax() for p, c in pairs]).max())


def _crop(image: torch.Tensor, region: np.ndarray) -> torch.Tensor:
    top, bottom, left, right = (int(v) for v in region)
    return image[:, top:bottom, left:right]
