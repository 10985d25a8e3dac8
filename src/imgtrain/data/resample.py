"""Crop, resize and flip a whole batch on its device in two matrix products: the device half of the batched input
path (dataset.decode=cuda, and data.augment_on=device).

torchvision's antialiased bilinear resize is separable: each output row is a weighted sum of input rows, with
PyTorch's triangle-filter weights (`_compute_indices_min_size_weights_aa` in aten's UpSampleKernel: centre
`scale * (i + 0.5)`, support `max(scale, 1)`, weights normalised to 1). Writing those weights for every image
of the batch as one matrix per axis, zero outside the image's crop box, gives the whole batch's crop, resize
and flip as `rows @ images @ cols^T`: two batched matmuls, whatever the boxes, instead of a crop view and an
interpolate call per image (pytorch/vision's transforms launch several kernels per image and hold the GIL
while they do). A flip is the column matrix reversed. The images may differ in size: they sit in a zero canvas
of the batch's largest size, and each image's weights reach only its own pixels.

The plan (each image's box per axis) is computed on the host from sizes and seeds alone, by the workers or the
decode thread; the weights are built on the device from it, so only [B, 11] numbers travel with the images.
Against torchvision's per-image uint8 kernels the pixels differ by its fixed-point rounding: at most 1 level
in float32 (tests/test_resample.py).
"""

from __future__ import annotations

import numpy as np
import torch

from imgtrain.data import batched

# One row per image: per axis (rows, then columns) the box's first pixel, its length, the resize's scale (input
# pixels per output pixel), the output index of the box's first row (the centre crop's offset) and the resized
# length; then the flip (1.0 or 0.0).
AXIS_FIELDS = 5
PLAN_WIDTH = 2 * AXIS_FIELDS + 1


def plan_batch(heights: np.ndarray, widths: np.ndarray, seeds: np.ndarray | None, spec: batched.CropSpec) -> np.ndarray:
    """[B, PLAN_WIDTH] float64: what `spec` does to each image of these sizes, its random draws from its seed."""
    random = spec.scale is not None or spec.flip_p > 0
    draws = batched.uniforms(seeds, batched.DRAWS) if random else None
    flips = draws[:, -1] < spec.flip_p if spec.flip_p > 0 else np.zeros(len(heights), dtype=bool)
    if spec.scale is not None:
        top, left, height, width = batched.random_boxes(heights, widths, draws, spec).T
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


def resample(images: torch.Tensor, plan: torch.Tensor, size: int, dtype: torch.dtype | None = None) -> torch.Tensor:
    """images [B, 3, H, W] (any dtype, each image at the top left of the canvas) -> [B, 3, size, size] in `dtype`,
    0..255: each cropped, resized and flipped as its plan row says. `dtype`: float32 on the CPU, float16 on CUDA
    by default (tensor cores, half the canvas; measured with the CPU's float16 matmul, within 0.26 levels
    of float32 and 1.125 of torchvision's uint8 kernel; CUDA's rounding is not yet measured)."""
    dtype = dtype or (torch.float16 if images.device.type == "cuda" else torch.float32)
    if plan.device != images.device and images.device.type == "cuda" and not plan.is_pinned():
        plan = plan.pin_memory()  # a copy from pageable memory would wait for the stream's queued kernels
    plan = plan.to(images.device, non_blocking=True).float()
    rows = axis_weights(plan[:, :AXIS_FIELDS], size, images.shape[-2]).to(dtype)
    cols = axis_weights(plan[:, AXIS_FIELDS : 2 * AXIS_FIELDS], size, images.shape[-1])
    cols = torch.where(plan[:, -1, None, None] > 0.5, cols.flip(1), cols).to(dtype)
    return rows[:, None] @ images.to(dtype) @ cols[:, None].transpose(-1, -2)


def axis_weights(axis: torch.Tensor, size: int, length: int) -> torch.Tensor:
    """[B, size, length] float32: output index i of image b takes input pixels with these weights (PyTorch's
    antialiased bilinear weights for the box's resize, zero outside the box, a zero row for centre-crop padding)."""
    start, extent, scale, first, resized = (axis[:, k, None, None] for k in range(AXIS_FIELDS))
    out = torch.arange(size, device=axis.device, dtype=torch.float32)[None, :, None] + first  # in the resized image
    centre = scale * (out + 0.5)  # in input pixels, from the box's first pixel
    support = scale.clamp(min=1.0)  # downscaling widens the triangle to `scale` input pixels (the antialiasing)
    pixel = torch.arange(length, device=axis.device, dtype=torch.float32)[None, None, :] - start
    weights = (1.0 - ((pixel - centre + 0.5) / support).abs()).clamp(min=0.0)
    inside = (pixel >= 0) & (pixel < extent) & (out >= 0) & (out < resized)
    weights = weights * inside
    total = weights.sum(-1, keepdim=True)
    return torch.where(total > 0, weights / total.clamp(min=1e-12), 0.0)


def canvas(images: list[torch.Tensor]) -> torch.Tensor:
    """uint8 images [3, H, W] of any sizes -> one zero-padded uint8 [B, 3, max H, max W], each at the top left
    (a plain stack when they share a size). One copy per image, no arithmetic: the crop and resize happen later,
    for the whole batch, in `resample`."""
    if all(image.shape == images[0].shape for image in images):
        return torch.stack(images)
    height = max(image.shape[-2] for image in images)
    width = max(image.shape[-1] for image in images)
    out = images[0].new_zeros((len(images), images[0].shape[0], height, width))
    for slot, image in zip(out, images, strict=True):
        slot[:, : image.shape[-2], : image.shape[-1]].copy_(image)
    return out


def sizes_of(images: list[torch.Tensor]) -> tuple[np.ndarray, np.ndarray]:
    """Heights and widths of [..., H, W] images, from their shapes (host metadata: no GPU sync)."""
    return (
        np.array([image.shape[-2] for image in images], dtype=np.int64),
        np.array([image.shape[-1] for image in images], dtype=np.int64),
    )
