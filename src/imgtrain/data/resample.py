"""Crop, resize and flip a whole batch on its device in two matrix products: the device half of the batched input
path (dataset.decode=cuda, and data.augment_on=device).

torchvision's antialiased bilinear resize is separable: each output row is a weighted sum of input rows, with
PyTorch's triangle-filter weights (`_compute_indices_min_size_weights_aa` in aten's UpSampleKernel: centre
`scale * (i + 0.5)`, support `max(scale, 1)`, weights normalised to 1). Writing those weights for every image
of the batch as one matrix per axis, zero outside the image's crop box, gives the whole batch's crop, resize
and flip as `rows @ images @ cols^T`: two batched matmuls, whatever the boxes, instead of a crop view and an
interpolate call per image (pytorch/vision's transforms launch several kernels per image and hold the GIL
while they do). A flip is the column matrix reversed. The images may differ in size: they sit in a zero canvas,
and each image's weights reach only its own pixels.

The canvas is bounded: each image is first cut to the window its weights reach (its crop box, and for
a centre crop the rows kept; a view, its plan's box moved by the offset, the weights the same to the bit), and the
windows, sorted by their longer side, are resampled in chunks of at most CHUNK_BYTES of canvas. The channels are
folded into the matmuls (columns first on [n, H*C, W], then rows on [n, H, C*size]), so no weights are broadcast
over them. One 4000x3000 photo among 255 ImageNet-sized images, training crop: 31.0 GB at the peak before, 0.74 GB
now (float16, counted without allocating: BENCHMARKS.md 2026-11-25; the script: git show
fa1e1a1:benchmarks/canvas_memory.py). With data.augment_on=device the worker ships one canvas of the windows
(`window_canvas`), padded to the batch's largest window, and `resample` takes it a chunk of consecutive images at
a time: only the working memory is bounded there.

The plan (each image's box per axis) is computed on the host from sizes and seeds alone, by the workers or the
decode thread; the weights are built on the device from it, so only [B, 11] numbers travel with the images.
Against torchvision's per-image uint8 kernels the pixels differ by its fixed-point rounding: at most 1 level
in float32 (tests/test_resample.py).
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import NamedTuple

import numpy as np
import torch

from imgtrain.data import batched
from imgtrain.data.copies import to_device

# One row per image: per axis (rows, then columns) the box's first pixel, its length, the resize's scale (input
# pixels per output pixel), the output index of the box's first row (the centre crop's offset) and the resized
# length; then the flip (1.0 or 0.0).
AXIS_FIELDS = 5
PLAN_WIDTH = 2 * AXIS_FIELDS + 1

# Bytes of canvas (in the matmuls' dtype) resampled at once. The smallest power of two in MiB that keeps the
# largest ordinary batch, 256 images of 384 px in float16 (226 MB), one chunk, hence one launch per pass. A chunk's
# working memory, canvas, weights and the intermediate [n, H, 3*size] together, stays under twice this for
# ImageNet-sized images (1.31 to 1.80 times in canvas_memory.py's four decode cases, BENCHMARKS.md 2026-11-25);
# relative to the canvas it grows for small windows, whose weights and intermediate are larger beside
# them. Larger batches, and mixed sizes above it, go in chunks of windows.
CHUNK_BYTES = 256 * 2**20


def plan_batch(
    heights: np.ndarray,
    widths: np.ndarray,
    seeds: np.ndarray | None,
    spec: batched.CropSpec,
    full: np.ndarray | None = None,
) -> np.ndarray:
    """[B, PLAN_WIDTH] float64: what `spec` does to each image of these sizes, its random draws from its seed. An
    image decoded at reduced scale (data/scaled_decode.py), with its `full` (height, width) [B, 2]: its training box
    is drawn on the full size and moved onto the image's pixel grid (`batched.map_boxes`), the box the workers crop
    (`batched.augment_batch`); validation resizes the whole image, the same at any scale, so it is planned on the
    image's own size, as the workers resize it. Every box is whole pixels: no weighted pixel falls outside it."""
    random = spec.scale is not None or spec.flip_p > 0
    draws = batched.uniforms(seeds, batched.DRAWS) if random else None
    flips = draws[:, -1] < spec.flip_p if spec.flip_p > 0 else np.zeros(len(heights), dtype=bool)
    if spec.scale is not None:
        if full is None:
            boxes = batched.random_boxes(heights, widths, draws, spec)
        else:
            boxes = batched.map_boxes(batched.random_boxes(full[:, 0], full[:, 1], draws, spec), full, heights, widths)
        top, left, height, width = boxes.T
        rows = _axis(top, height, height / spec.size, 0, spec.size)
        cols = _axis(left, width, width / spec.size, 0, spec.size)
    else:
        new_h, new_w = _resized_sizes(heights, widths, spec)
        rows = _axis(0, heights, heights / new_h, _centre_offset(new_h, spec.size), new_h)
        cols = _axis(0, widths, widths / new_w, _centre_offset(new_w, spec.size), new_w)
    return np.concatenate([rows, cols, flips[:, None].astype(np.float64)], axis=1)


def _axis(start, length, scale, first, resized) -> np.ndarray:
    columns = np.broadcast_arrays(*(np.asarray(v, dtype=np.float64) for v in (start, length, scale, first, resized)))
    return np.stack(columns, axis=1)


def _resized_sizes(heights: np.ndarray, widths: np.ndarray, spec: batched.CropSpec) -> tuple[np.ndarray, np.ndarray]:
    """torchvision's Resize output: both sides to `size`, or the short side to `resize` and the long side to
    int(resize * long / short) (v2's `_compute_resized_output_size`)."""
    if spec.resize is None:
        return np.full_like(heights, spec.size), np.full_like(widths, spec.size)
    short, long = np.minimum(heights, widths), np.maximum(heights, widths)
    new_long = (spec.resize * long / short).astype(np.int64)
    portrait = widths <= heights
    return np.where(portrait, new_long, spec.resize), np.where(portrait, spec.resize, new_long)


def _centre_offset(resized: np.ndarray, size: int) -> np.ndarray:
    """CenterCrop's first row in the resized image: round((n - size) / 2) (half to even, as Python's round), or
    minus the padding when the image is smaller than the crop."""
    return np.where(resized >= size, np.round((resized - size) / 2.0), -((size - resized) // 2))


def resample_images(
    images: list[torch.Tensor], plan: np.ndarray, size: int, dtype: torch.dtype | None = None, budget: int = CHUNK_BYTES
) -> torch.Tensor:
    """Images [C, H, W] of any sizes and dtype on one device, with their plan rows [B, PLAN_WIDTH] (host) -> float
    [B, C, size, size] in `dtype` (default as `resample`), 0..255: the decode path's entry. Images of one shape
    that fit `budget` go as one stack; others are cut to their windows and resampled a chunk at a time."""
    device = images[0].device
    dtype = dtype or _default_dtype(device)
    chunks = chunk_windows(images, plan, size, images[0].shape[0] * dtype.itemsize, budget)
    if len(chunks) == 1 and chunks[0].windows is images:  # one stack: a copy, not one per image
        return resample(torch.stack(images), torch.from_numpy(plan), size, dtype, budget)
    # One host-to-device copy for the batch: the shifted plan rows in chunk order, then each row's slot in `out`
    order = np.concatenate([chunk.index for chunk in chunks])
    rows = np.concatenate([np.concatenate([chunk.plan for chunk in chunks]), order[:, None]], axis=1)
    rows = to_device(torch.from_numpy(rows), device)
    out = torch.empty((len(images), images[0].shape[0], size, size), dtype=dtype, device=device)
    first = 0
    for chunk in chunks:
        last = first + len(chunk.index)
        height, width = (max(w.shape[axis] for w in chunk.windows) for axis in (-2, -1))
        make = partial(canvas, chunk.windows, dtype, rows_first=True)
        part = _two_products(make, height, width, rows[first:last].float(), size, dtype)
        out.index_copy_(0, rows[first:last, PLAN_WIDTH].long(), part.transpose(1, 2))
        first, part = last, None  # not kept alive through the next chunk's products
    return out


def resample(
    images: torch.Tensor, plan: torch.Tensor, size: int, dtype: torch.dtype | None = None, budget: int = CHUNK_BYTES
) -> torch.Tensor:
    """images [B, C, H, W] (any dtype, each image at the top left of the canvas) -> [B, C, size, size] in `dtype`,
    0..255: each cropped, resized and flipped as its plan row says, `budget` bytes of canvas in `dtype` at a time
    (consecutive images: a canvas shipped whole, RawBatch). `dtype`: float32 on the CPU, float16 on CUDA by
    default (tensor cores, half the canvas; measured with the CPU's float16 matmul on tests/test_resample.py's
    images, within 0.24 levels of float32 and 1.00 of torchvision's uint8 kernel, 0.26 and 1.125 with af14a6e's
    rows-first order; CUDA's rounding is not yet measured)."""
    dtype = dtype or _default_dtype(images.device)
    plan = to_device(plan, images.device).float()
    count, channels, height, width = images.shape
    step = max(1, budget // (channels * height * width * dtype.itemsize))
    out = images.new_empty((count, channels, size, size), dtype=dtype)
    for first in range(0, count, step):
        make = partial(_rows_first, images[first : first + step], dtype)
        part = _two_products(make, height, width, plan[first : first + step], size, dtype)
        out[first : first + step] = part.transpose(1, 2)
        del part  # not kept alive through the next chunk's products
    return out


def _rows_first(images: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[n, C, H, W] -> a copy [n, H, C, W] in `dtype` (one kernel: the conversion and the transposition)."""
    count, channels, height, width = images.shape
    return images.new_empty((count, height, channels, width), dtype=dtype).copy_(images.transpose(1, 2))


def _two_products(
    make_canvas: Callable[[], torch.Tensor], height: int, width: int, plan: torch.Tensor, size: int, dtype: torch.dtype
) -> torch.Tensor:
    """The canvas `make_canvas()` gives, [n, height, C, width] in `dtype` (each image's rows hold its channels side by
    side) -> [n, size, C, size]. Columns first on the canvas viewed as [n, height*C, width], which gives
    [n, height, C*size]: the rows' matmul takes that as it is, so no weights are broadcast over the channels and
    nothing larger than that is written between the two. The weights are made first, so that their float32
    temporaries are freed before the canvas exists, and the canvas is freed before the second product."""
    cols = axis_weights(plan[:, AXIS_FIELDS : 2 * AXIS_FIELDS], size, width, plan[:, 2 * AXIS_FIELDS]).to(dtype)
    rows = axis_weights(plan[:, :AXIS_FIELDS], size, height).to(dtype)
    images = make_canvas()
    count, channels = images.shape[0], images.shape[2]
    across = images.view(count, height * channels, width) @ cols.transpose(1, 2)
    del images  # the only reference: the canvas's memory is free for the second product
    return (rows @ across.view(count, height, channels * size)).view(count, size, channels, size)


def _default_dtype(device: torch.device) -> torch.dtype:
    return torch.float16 if device.type == "cuda" else torch.float32


def axis_weights(axis: torch.Tensor, size: int, length: int, flip: torch.Tensor | None = None) -> torch.Tensor:
    """[B, size, length] float32: output index i of image b takes input pixels with these weights (PyTorch's
    antialiased bilinear weights for the box's resize, zero outside the box, a zero row for centre-crop padding);
    `flip` [B] above 0.5: the rows in reverse order (a horizontal flip, for the column weights). One [B, size,
    length] buffer, worked on in place: the same operations in the same order as out of place, to the bit."""
    start, extent, scale, first, resized = (axis[:, k, None, None] for k in range(AXIS_FIELDS))
    index = torch.arange(size, device=axis.device, dtype=torch.float32)[None, :, None]
    if flip is not None:
        index = torch.where(flip[:, None, None] > 0.5, size - 1 - index, index)
    out = index + first  # in the resized image
    centre = scale * (out + 0.5)  # in input pixels, from the box's first pixel
    support = scale.clamp(min=1.0)  # downscaling widens the triangle to `scale` input pixels (the antialiasing)
    pixel = torch.arange(length, device=axis.device, dtype=torch.float32)[None, None, :] - start
    weights = (pixel - centre).add_(0.5).div_(support).abs_().neg_().add_(1.0).clamp_(min=0.0)  # 1 - |...|
    weights.mul_((pixel >= 0) & (pixel < extent)).mul_((out >= 0) & (out < resized))  # 0 outside the box, the crop
    # Exact, hence the same whatever the row's length or order: the weights are multiples of 2**-24 in [0, 1] (1 - y
    # in float32), so a float64 sum of fewer than 2**29 of them does not round. A window's weights are then the
    # whole canvas's to the bit (crop_to_windows); float32's sum rounded by its order, which depends on the length.
    total = weights.sum(-1, keepdim=True, dtype=torch.float64).float()
    return weights.div_(total.clamp_(min=1e-12))  # a row of zeros (total 0) stays zeros


class Chunk(NamedTuple):
    """Images resampled together: their slots in the batch, the images (or their windows) and plan rows."""

    index: np.ndarray
    windows: list[torch.Tensor]
    plan: np.ndarray


def chunk_windows(
    images: list[torch.Tensor], plan: np.ndarray, size: int, pixel_bytes: int, budget: int
) -> list[Chunk]:
    """The batch in chunks whose canvas holds at most `budget` bytes (`pixel_bytes` a pixel, all channels; an
    image larger than that alone): the whole images in one chunk when they share a shape and fit (one stack, no
    copy per image), else the windows, sorted by their longer side so each chunk pads little."""
    count = len(images)
    if _one_shape(images) and count * images[0].numel() // images[0].shape[0] * pixel_bytes <= budget:
        return [Chunk(np.arange(count), images, plan)]
    cut, shifted = crop_to_windows(images, plan, size)
    heights, widths = sizes_of(cut)
    chunks, members, height, width = [], [], 0, 0
    for i in np.argsort(-np.maximum(heights, widths), kind="stable"):
        grown = max(height, heights[i]), max(width, widths[i])
        if members and (len(members) + 1) * grown[0] * grown[1] * pixel_bytes > budget:
            chunks.append(members)
            members, grown = [], (heights[i], widths[i])
        members.append(i)
        height, width = grown
    chunks.append(members)
    return [Chunk(np.array(m), [cut[i] for i in m], shifted[m]) for m in chunks]


def windows(plan: np.ndarray, size: int) -> np.ndarray:
    """[B, 4] int64 (top, bottom, left, right), bottom and right exclusive: the pixels each plan row's weights can
    reach, inside its box and within the filter's support of the output rows kept (`axis_weights`)."""
    return np.concatenate(
        [_axis_window(plan[:, :AXIS_FIELDS], size), _axis_window(plan[:, AXIS_FIELDS : 2 * AXIS_FIELDS], size)], 1
    )


def _axis_window(axis: np.ndarray, size: int) -> np.ndarray:
    start, extent, scale, first, resized = axis.T
    kept_first, kept_last = np.maximum(first, 0), np.minimum(first + size, resized) - 1  # in the resized image
    support = np.maximum(scale, 1.0)
    # Pixel p (from the box's first) has weight where |p + 0.5 - scale * (i + 0.5)| < support; one pixel more each
    # side covers float32's rounding of the same on the device (relative 6e-8: 2.4e-4 px at 4000 px)
    low = np.floor(scale * (kept_first + 0.5) - support - 0.5) - 1
    high = np.ceil(scale * (kept_last + 0.5) + support - 0.5) + 1
    low = np.where(kept_last < kept_first, 0, np.clip(low, 0, extent - 1))  # no row kept: any one pixel, weight 0
    high = np.clip(high, low + 1, extent)
    # Outward to whole pixels: a plan's box may start between pixels (a fork's plan), and truncating its end would
    # drop the last pixel it weights
    return np.stack([np.floor(start + low), np.ceil(start + high)], axis=1).astype(np.int64)


def crop_to_windows(images: list[torch.Tensor], plan: np.ndarray, size: int) -> tuple[list[torch.Tensor], np.ndarray]:
    """Each image cut to its window (a view) and its plan row's box moved by the window's offset: the weights are
    the same numbers on the window's pixels (integer positions, exact in float32) and the window holds all the
    nonzero ones, so the output is the same; the canvas holds windows instead of whole images."""
    bounds, shifted = plan_in_windows(plan, size)
    cut = [image[..., top:bottom, left:right] for image, (top, bottom, left, right) in zip(images, bounds, strict=True)]
    return cut, shifted


def plan_in_windows(plan: np.ndarray, size: int) -> tuple[np.ndarray, np.ndarray]:
    """(each plan row's window, `windows`; the plan with each box moved by its window's offset): the plan of the
    windows alone, for a decoder that decodes only them (data/region_decode.py)."""
    bounds = windows(plan, size)
    shifted = plan.copy()
    shifted[:, 0] -= bounds[:, 0]
    shifted[:, AXIS_FIELDS] -= bounds[:, 2]
    return bounds, shifted


def window_canvas(images: list[torch.Tensor], plan: np.ndarray, size: int) -> tuple[torch.Tensor, np.ndarray]:
    """A worker's uint8 canvas for the device (RawBatch) and its plan: the windows, or the whole images when they
    share a shape and their windows do not (a stack, and the windows' canvas would be about as large)."""
    cut, shifted = crop_to_windows(images, plan, size)
    if _one_shape(images) and not _one_shape(cut):
        return canvas(images), plan
    return canvas(cut), shifted


def window_canvas_bytes(images: list[torch.Tensor], plan: np.ndarray, size: int) -> int:
    """The bytes of the uint8 canvas `window_canvas` would make, without making it."""
    bounds = windows(plan, size)
    heights, widths = bounds[:, 1] - bounds[:, 0], bounds[:, 3] - bounds[:, 2]
    if _one_shape(images) and (len(set(heights)) > 1 or len(set(widths)) > 1):
        return len(images) * images[0].numel()
    return len(images) * images[0].shape[0] * int(heights.max()) * int(widths.max())


def canvas(images: list[torch.Tensor], dtype: torch.dtype | None = None, rows_first: bool = False) -> torch.Tensor:
    """Images [C, H, W] of any sizes -> one zero-padded [B, C, max H, max W] in `dtype` (default theirs), each at the
    top left (a plain stack when they share a size); `rows_first`: [B, max H, C, max W] (`_two_products`).
    One copy per image, no arithmetic: the crop and resize happen later, for the whole batch."""
    dtype = dtype or images[0].dtype
    same = _one_shape(images)
    if same and not rows_first and dtype == images[0].dtype:
        return torch.stack(images)
    channels = images[0].shape[0]
    height = max(image.shape[-2] for image in images)
    width = max(image.shape[-1] for image in images)
    shape = (len(images), height, channels, width) if rows_first else (len(images), channels, height, width)
    out = images[0].new_empty(shape, dtype=dtype) if same else images[0].new_zeros(shape, dtype=dtype)
    for slot, image in zip(out, images, strict=True):
        if rows_first:
            slot[: image.shape[-2], :, : image.shape[-1]].copy_(image.transpose(0, 1))
        else:
            slot[:, : image.shape[-2], : image.shape[-1]].copy_(image)
    return out


def _one_shape(images: list[torch.Tensor]) -> bool:
    return all(image.shape == images[0].shape for image in images)


def sizes_of(images: list[torch.Tensor]) -> tuple[np.ndarray, np.ndarray]:
    """Heights and widths of [..., H, W] images, from their shapes (host metadata: no GPU sync)."""
    return (
        np.array([image.shape[-2] for image in images], dtype=np.int64),
        np.array([image.shape[-1] for image in images], dtype=np.int64),
    )
