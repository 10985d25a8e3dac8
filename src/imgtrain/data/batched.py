"""Augmentation per batch: every sample's crop box and flip drawn at once from the samples' seeds, then the batch
cropped, resized and flipped together.

Per sample, only what must be: reading and decoding the file. The random draws are a pure function of each
sample's seed (SplitMix64, in NumPy for the whole batch): no generator is seeded per sample, the result does not
depend on the batch or the worker, and a resumed epoch draws the same boxes. The boxes follow RandomResizedCrop's
algorithm (up to 10 tries of a scale and a log-uniform aspect ratio, then the centre crop), with other random
numbers than torchvision's generator would give. A policy (dataset.augment) and random erasing follow the crop:
data/policies.py.

The resize, measured per image on one core of the 2-core development machine (`benchmarks/bench.py --only
resize-kernels`, BENCHMARKS.md, 2026-11-24 20:50):
- small images of one size: one `torchvision.ops.roi_align` call for the group, 0.0125 ms at 32 px, against
  0.0222 for torchvision's uint8 resize called per image and 0.0501 for the v2 transform per sample; at 48 px
  the first two tie (0.027, 0.026), so the group call is kept up to 40 px;
- larger images: torchvision's uint8 antialiased resize per image. Its SIMD kernel works on the crop alone, in
  uint8; roi_align works in float: 0.032 against 0.050 ms at 64 px, 0.35 against 2.8 ms for a 500x375 JPEG to
  224 px. Each call is one C++ kernel, with no transform machinery around it (`resized_crop`: the crop handed to
  it as the channels-last block it works on, written once into the batch collate hands over, `crop_batch`).

The batch is channels-last in memory ([B, 3, S, S] viewed from [B, S, S, 3]): what the kernel writes, and what the
model takes on CUDA (system.channels_last=auto); the feed converts it to the model's format on the device.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import torch
import torchvision.transforms.v2.functional as F
from torchvision.ops import roi_align
from torchvision.transforms import v2

from imgtrain.data.policies import RESIZING, ErasingSpec, apply_policy, erasing_of, uniforms

MAX_TRIES = 10  # RandomResizedCrop's attempts at a box inside the image before it falls back to the centre crop
ROI_ALIGN_MAX_SIDE = 40  # px: up to here one roi_align call for a group of same-size images beats a call per image
DRAWS = 2 * MAX_TRIES + 3  # uniforms per sample: scale and ratio per try, top, left, flip
CIFAR_PAD = 4  # pixels of zero padding before the random crop (the CIFAR recipe)
CROPS = (v2.RandomResizedCrop, v2.Resize, v2.CenterCrop)  # the head a CropSpec describes


@dataclass(frozen=True)
class CropSpec:
    """What a split's transform asks for, in a form one call can apply to a batch.

    Training: RandomResizedCrop to `size` (`scale`, `ratio`), then a horizontal flip with probability `flip_p`.
    Evaluation (`scale` None): resize the short side to `resize` (None: both sides to `size`), centre crop `size`.
    Then the `policy` transforms, per sample (dataset.augment: TrivialAugmentWide, ...), and random `erasing`, per
    batch (data/policies.py).
    """

    size: int
    scale: tuple[float, float] | None = None
    ratio: tuple[float, float] = (3 / 4, 4 / 3)
    flip_p: float = 0.0
    resize: int | None = None
    policy: tuple[Any, ...] = ()
    erasing: ErasingSpec | None = None


def spec_of(transform: Any) -> CropSpec | None:
    """The CropSpec of the transforms built in data/datasets.py (bilinear, antialiased), else None: any other
    transform keeps the per-sample path. The head is the crop (and resize), then an optional flip; what follows is
    the policy, then a trailing v2.RandomErasing with a constant fill."""
    steps = list(transform.transforms) if isinstance(transform, v2.Compose) else [transform]
    erasing = erasing_of(steps[-1]) if len(steps) > 1 and isinstance(steps[-1], v2.RandomErasing) else None
    if erasing is not None:
        steps.pop()
    head = next((i for i, step in enumerate(steps) if not isinstance(step, CROPS)), len(steps))
    flip = head < len(steps) and isinstance(steps[head], v2.RandomHorizontalFlip)
    policy = tuple(steps[head + flip :])
    crop = _crop_spec(steps[:head], steps[head].p if flip else 0.0)
    if crop is None or any(isinstance(step, (*RESIZING, v2.Compose)) for step in policy):
        return None  # a nested Compose may hide a resize: per sample
    return replace(crop, policy=policy, erasing=erasing)


def _crop_spec(steps: list[Any], flip_p: float) -> CropSpec | None:
    """The crop head's CropSpec: RandomResizedCrop, a square Resize, or Resize then CenterCrop."""
    if not all(_bilinear(step) for step in steps if isinstance(step, v2.RandomResizedCrop | v2.Resize)):
        return None
    if len(steps) == 1 and isinstance(steps[0], v2.RandomResizedCrop) and _square(steps[0].size):
        crop = steps[0]
        return CropSpec(crop.size[0], tuple(crop.scale), tuple(crop.ratio), flip_p)
    if len(steps) == 1 and isinstance(steps[0], v2.Resize) and square_bilinear_resize(steps[0]):
        return CropSpec(steps[0].size[0], flip_p=flip_p)
    if len(steps) == 2 and isinstance(steps[0], v2.Resize) and isinstance(steps[1], v2.CenterCrop):
        resize, crop = steps[0].size, steps[1].size
        if len(resize) == 1 and steps[0].max_size is None and _square(crop):
            return CropSpec(crop[0], flip_p=flip_p, resize=resize[0])
    return None


def square_bilinear_resize(step: v2.Resize) -> bool:
    """A Resize of both sides to one size, bilinear and antialiased: the one resize the batch paths apply."""
    return len(step.size) == 2 and _square(step.size) and _bilinear(step)


def _bilinear(step: Any) -> bool:
    mode = getattr(step.interpolation, "value", step.interpolation)
    return str(mode).lower() == "bilinear" and step.antialias is not False


def _square(size: Any) -> bool:
    return size is not None and len(size) in (1, 2) and size[0] == size[-1]


def random_boxes(heights: np.ndarray, widths: np.ndarray, draws: np.ndarray, spec: CropSpec) -> np.ndarray:
    """RandomResizedCrop's boxes [B, 4] (top, left, height, width) for images of these sizes, from `draws`."""
    area = (heights * widths)[:, None]
    scale = draws[:, :MAX_TRIES] * (spec.scale[1] - spec.scale[0]) + spec.scale[0]
    log_low, log_high = np.log(spec.ratio[0]), np.log(spec.ratio[1])
    aspect = np.exp(draws[:, MAX_TRIES : 2 * MAX_TRIES] * (log_high - log_low) + log_low)
    w = np.rint(np.sqrt(area * scale * aspect)).astype(np.int64)
    h = np.rint(np.sqrt(area * scale / aspect)).astype(np.int64)
    fits = (w > 0) & (h > 0) & (w <= widths[:, None]) & (h <= heights[:, None])
    first = fits.argmax(axis=1)  # the first try that fits, as RandomResizedCrop takes it
    rows = np.arange(len(heights))
    h, w = h[rows, first], w[rows, first]
    top = np.floor(draws[:, 2 * MAX_TRIES] * (heights - h + 1)).astype(np.int64)
    left = np.floor(draws[:, 2 * MAX_TRIES + 1] * (widths - w + 1)).astype(np.int64)
    boxes = np.stack([top, left, h, w], axis=1)
    none_fit = ~fits.any(axis=1)
    if none_fit.any():
        boxes[none_fit] = _centre_boxes(heights[none_fit], widths[none_fit], spec.ratio)
    return boxes


def _centre_boxes(heights: np.ndarray, widths: np.ndarray, ratio: tuple[float, float]) -> np.ndarray:
    """RandomResizedCrop's fallback: the whole image, cut to the nearest allowed aspect ratio, centred."""
    in_ratio = widths / heights
    w = np.where(in_ratio < ratio[0], widths, np.where(in_ratio > ratio[1], np.rint(heights * ratio[1]), widths))
    h = np.where(in_ratio < ratio[0], np.rint(widths / ratio[0]), heights)
    w, h = w.astype(np.int64), h.astype(np.int64)
    return np.stack([(heights - h) // 2, (widths - w) // 2, h, w], axis=1)


def augment_batch(
    images: list[torch.Tensor], seeds: np.ndarray | None, spec: CropSpec, full: np.ndarray | None = None
) -> list[torch.Tensor]:
    """uint8 images [3, H, W] of any sizes -> uint8 [3, size, size] each: `crop_batch`, then through the spec's
    policy, per sample (data/policies.py). Random erasing is collate's, on the stacked batch."""
    return apply_policy(list(crop_batch(images, seeds, spec, full)), seeds, spec.policy)


def crop_batch(
    images: list[torch.Tensor],
    seeds: np.ndarray | None,
    spec: CropSpec,
    full: np.ndarray | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """uint8 images [3, H, W] of any sizes cropped and resized as `spec` says, flipped where each seed's draw says
    (`seeds` may be None for a spec without randomness), each written once into `out` [B, 3, size, size]: by
    default a new channels-last batch (`channels_last_batch`); collate's is in shared memory inside a worker.

    `full` [B, 2]: each image's (height, width) at full scale where it was decoded smaller (data/scaled_decode.py):
    its box is drawn on that size, as for the full image, then mapped onto the image."""
    random = spec.scale is not None or spec.flip_p > 0
    draws = uniforms(seeds, DRAWS) if random else None
    flips = draws[:, -1] < spec.flip_p if spec.flip_p > 0 else np.zeros(len(images), dtype=bool)
    out = channels_last_batch(len(images), spec.size, images[0]) if out is None else out
    if spec.scale is None:  # the whole image resized: the same at any scale
        for i, (image, flip) in enumerate(zip(images, flips, strict=True)):
            crop = _evaluation_crop(image, spec)
            out[i] = crop.flip(-1) if flip else crop
    else:
        _crop_resize_flip(images, image_boxes(images, draws, spec, full), flips, out)
    return out


def channels_last_batch(count: int, size: int, like: torch.Tensor, shared: bool = False) -> torch.Tensor:
    """An empty batch [count, C, size, size] of `like`'s channels and dtype, channels-last in memory (each image's
    pixels RGB after RGB, as `resized_crop` makes them); `shared`: in shared memory, allocated as default_collate
    allocates its batches inside a worker, so that it reaches the training process without a copy."""
    shape = (count, size, size, like.shape[0])
    if shared:
        rows = like.new(like._typed_storage()._new_shared(math.prod(shape), device=like.device)).view(shape)
    else:
        rows = torch.empty(shape, dtype=like.dtype)
    return rows.permute(0, 3, 1, 2)


def image_boxes(
    images: list[torch.Tensor], draws: np.ndarray, spec: CropSpec, full: np.ndarray | None = None
) -> np.ndarray:
    """`random_boxes` for these images [..., H, W] (their sizes are host metadata: no sync on a GPU), drawn on
    their `full` sizes [B, 2] where given and mapped onto the images."""
    heights = np.array([image.shape[-2] for image in images], dtype=np.int64)
    widths = np.array([image.shape[-1] for image in images], dtype=np.int64)
    if full is None:
        return random_boxes(heights, widths, draws, spec)
    return map_boxes(random_boxes(full[:, 0], full[:, 1], draws, spec), full, heights, widths)


def map_boxes(boxes: np.ndarray, full: np.ndarray, heights: np.ndarray, widths: np.ndarray) -> np.ndarray:
    """Boxes [B, 4] (top, left, height, width) drawn on the `full` sizes [B, 2] moved onto images of these sizes,
    on their pixel grid (`_mapped`): the one mapping both the workers and the device (data/resample.py) crop."""
    rows = _mapped(boxes[:, 0], boxes[:, 2], heights / full[:, 0], heights)
    cols = _mapped(boxes[:, 1], boxes[:, 3], widths / full[:, 1], widths)
    return np.stack([rows[0], cols[0], rows[1], cols[1]], axis=1)


def _mapped(start: np.ndarray, length: np.ndarray, factor: np.ndarray, limit: np.ndarray) -> tuple:
    """A box's (start, length) along one axis on an image `factor` times the size: each edge rounded to the
    nearest pixel (half a pixel of the smaller image at most), at least one pixel long, inside the image. A factor
    of 1 gives the box unchanged."""
    first = np.clip(np.rint(start * factor), 0, limit - 1).astype(np.int64)
    end = np.clip(np.rint((start + length) * factor), first + 1, limit).astype(np.int64)
    return first, end - first


def _crop_resize_flip(images: list[torch.Tensor], boxes: np.ndarray, flips: np.ndarray, out: torch.Tensor) -> None:
    """Each image's box resized to out's size and flipped where asked, into `out`: one roi_align call per group of
    small same-size images, else torchvision's uint8 resize per image (see the module docstring for why), each
    crop copied into the batch while it is in the cache and dropped: one crop's memory at a time, reused, where a
    list of crops stacked at the end held a second batch of them."""
    size = out.shape[-1]
    groups: dict[tuple[int, ...], list[int]] = {}
    for i, image in enumerate(images):
        groups.setdefault(tuple(image.shape), []).append(i)
    for shape, members in groups.items():
        if len(members) > 1 and max(shape[-2:]) <= ROI_ALIGN_MAX_SIDE:
            group = _roi_align_group(torch.stack([images[i] for i in members]), boxes[members], size)
            flip = torch.from_numpy(flips[members])
            out[members] = torch.where(flip[:, None, None, None], group.flip(-1), group)
            continue
        for i in members:
            out[i] = resized_crop(images[i], *(int(v) for v in boxes[i]), size, bool(flips[i]))


def resized_crop(image: torch.Tensor, top: int, left: int, height: int, width: int, size: int, flip: bool):
    """uint8 [3, H, W] -> [3, size, size], channels-last in memory: torchvision's `resized_crop` (its own kernel,
    `resize_image`: bilinear, antialiased), then the flip, with the same pixels and less work around the kernel.

    The box is copied to its own channels-last block first (flipped in that copy where asked: the filter is mirror
    symmetric, so resizing the mirrored box gives the mirrored result): on such a block the uint8 kernel reads and
    writes RGB rows directly. On a box that is a view of the decoded image (row stride of the whole image) it
    would copy the box, resize, then repack its output into planes, 1.4M of the 3.9M instructions it took per
    500x375 JPEG's crop (callgrind, benchmarks/per_core.py), and the flip was one more pass over the output."""
    box = image.permute(1, 2, 0)[top : top + height, left : left + width]  # [h, w, 3]: rows of RGB pixels
    box = box.flip(1).contiguous() if flip else box.contiguous()  # flip keeps a planar image's order: then 2 copies
    return F.resize_image(box[None].permute(0, 3, 1, 2), [size, size], antialias=True)[0]


def _roi_align_group(images: torch.Tensor, boxes: np.ndarray, size: int) -> torch.Tensor:
    """Bilinear samples at the pixel centres of each box, as torchvision's resize takes them (half-pixel
    convention, `aligned=True`); a box larger than the output averages ceil(box / output) samples per pixel."""
    top, left, height, width = (torch.from_numpy(boxes[:, k]).float() for k in range(4))
    rois = torch.stack([torch.arange(len(boxes), dtype=torch.float32), left, top, left + width, top + height], 1)
    resized = roi_align(images.float(), rois, (size, size), spatial_scale=1.0, sampling_ratio=-1, aligned=True)
    return resized.round_().clamp_(0, 255).to(torch.uint8)


def _evaluation_crop(image: torch.Tensor, spec: CropSpec) -> torch.Tensor:
    """The evaluation transform's own kernels, so validation images are the per-sample path's exactly."""
    if spec.resize is None:
        return F.resize(image, [spec.size, spec.size], antialias=True)
    return F.center_crop(F.resize(image, [spec.resize], antialias=True), [spec.size, spec.size])


def pad_crop_flip(images: torch.Tensor, seeds: torch.Tensor, pad: int = CIFAR_PAD) -> torch.Tensor:
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
