"""JPEGs decoded at 1/2, 1/4 or 1/8 scale when the crop needs no more pixels (dataset.scaled_decode).

libjpeg-turbo scales in the DCT domain: at 1/8 it inverse-transforms one coefficient of each 8x8 block, not 64. A
RandomResizedCrop box of 1000 px resized to 224 px uses a quarter of the pixels a full decode gives it; decoding
at 1/4 gives those and no more. The box is drawn as today, from the sample's seed and the image's full (upright)
size, so the crops' distribution does not change; it is then mapped onto the smaller image (data/batched.py,
data/resample.py), which moves its edges by at most half a pixel of the smaller image.

The scale is the smallest of 1/8, 1/4, 1/2 that leaves the region the transform takes at least the output's size
on both sides: the box in training, the whole image in validation (its shorter side at least the resize). Only
downscaling is ever added, never an upscale. What decodes (measured on one core, BENCHMARKS.md 2026-11-27 09:38):
simplejpeg where it is installed (1.35-1.37x the full decode's rate for 6-MP photos at 1/4, 2.05-2.13x for 12-MP
ones at 1/8), else PIL's `draft` (1.22-1.24x, 1.88-2.01x); both are libjpeg-turbo. The files it does not apply to
decode in full, as before: scale 1 (ImageNet-sized files at 224 px), CMYK/YCCK JPEGs, and every other format.

dataset.max_image_pixels bounds what the decoder holds. A baseline photo decoded at 1/8 is decoded a row of 8x8
blocks at a time into its smaller image, so the limit counts that image's pixels: a 100-MP photo at 1/8 holds
1.6 MP. A progressive JPEG (or one whose first scan lacks a component) is not: libjpeg keeps the whole image's DCT
coefficients until its last scan, 2 bytes a sample (about 3 bytes a pixel at 4:2:0) at any output scale, so its
header's pixels count, as in a full decode (a 2-KB file claiming 30000 x 30000 held 2.7 GB for 7 s at 1/8 before).
PIL's own guard is lifted for its draft: the key is the one limit on every path.
"""

from __future__ import annotations

import importlib
import importlib.util
import math
from typing import NamedTuple

import numpy as np
import torch

from imgtrain.data import batched
from imgtrain.data.batched import CropSpec
from imgtrain.data.decoders import OversizedImage, decode_bytes, decode_jpeg, pil_opened, upright
from imgtrain.data.jpeg import JpegFrame, jpeg_header, too_many_pixels
from imgtrain.data.policies import uniforms

# Optional: found by name, so that a machine without it (the GPU box's fixed environment) decodes with PIL's draft
simplejpeg = importlib.import_module("simplejpeg") if importlib.util.find_spec("simplejpeg") else None

DENOMINATORS = (8, 4, 2)  # libjpeg-turbo's power-of-two scales, largest reduction first


class Reduced(NamedTuple):
    """An image decoded at a reduced scale, turned upright: uint8 [3, h, w], and its upright (height, width) at full
    scale, on which its crop box is drawn before being mapped onto `image`."""

    image: torch.Tensor
    full: tuple[int, int]


def with_full_size(decoded: torch.Tensor | Reduced) -> tuple[torch.Tensor, tuple[int, int] | None]:
    """(the image, its full (height, width) where it was decoded smaller, else None): what an Uncropped holds."""
    return (decoded.image, decoded.full) if isinstance(decoded, Reduced) else (decoded, None)


def binding() -> str:
    """What decodes at reduced scale here, for metrics.json's environment and the docs."""
    return f"simplejpeg {simplejpeg.__version__}" if simplejpeg is not None else "PIL's draft (simplejpeg absent)"


def denominator(height: int, width: int, seed: int | None, spec: CropSpec) -> int:
    """The largest of DENOMINATORS that leaves the region `spec` takes from an upright image of `height` x `width`
    (its box drawn from `seed` in training) at least the output's size on both sides; 1 if none does."""
    if min(height, width) < 2 * spec.size:  # no box or resize can use half of it: ImageNet-sized files stop here
        return 1
    if spec.scale is not None:
        draws = uniforms(np.array([0 if seed is None else seed], dtype=np.int64), batched.DRAWS)
        box = batched.random_boxes(np.array([height]), np.array([width]), draws, spec)[0]
        need_h, need_w, least = int(box[2]), int(box[3]), spec.size
    elif spec.resize is None:  # both sides resized to `size`
        need_h, need_w, least = height, width, spec.size
    else:  # the shorter side resized to `resize`
        need_h = need_w = min(height, width)
        least = spec.resize
    return next((d for d in DENOMINATORS if need_h // d >= least and need_w // d >= least), 1)


def decode_for_crop(
    data: torch.Tensor, path: str, max_pixels: int | None, seed: int | None, spec: CropSpec
) -> torch.Tensor | Reduced:
    """An image file's bytes decoded for `spec`'s crop: a JPEG the crop needs fewer pixels of at reduced scale
    (Reduced), anything else as `decode_bytes` decodes it (errors included: a damaged file raises its usual one)."""
    view = memoryview(data.numpy())
    frame = jpeg_header(view)
    if frame is None:  # another format, or markers that do not read: as before, the decoder's error included
        return decode_bytes(data, path, max_pixels)
    height, width = frame.upright_size
    d = denominator(height, width, seed, spec) if frame.components in (1, 3) else 1  # CMYK/YCCK: in full
    if d == 1:  # the header already read: decoded in full without reading it again
        return decode_jpeg(data, frame, max_pixels)
    if frame.held_whole:  # libjpeg holds every coefficient whatever the scale: the header's pixels count
        too_large = too_many_pixels(frame.width, frame.height, max_pixels)
        if too_large:
            raise OversizedImage(f"{too_large}; not decoded (a progressive JPEG is held whole at any scale)")
    too_large = too_many_pixels(math.ceil(frame.width / d), math.ceil(frame.height / d), max_pixels)
    if too_large:
        raise OversizedImage(f"{too_large} at 1/{d} scale; not decoded")
    try:
        image = _scaled(view, frame, d)
    except (ValueError, OSError):  # what libjpeg-turbo refuses at reduced scale, the full decoder names
        return decode_jpeg(data, frame, max_pixels)
    return Reduced(upright(image, frame.orientation), (height, width))


def _scaled(view: memoryview, frame: JpegFrame, d: int) -> torch.Tensor:
    """uint8 [3, ceil(H/d), ceil(W/d)] as stored (not yet upright), from libjpeg-turbo's scaled IDCT."""
    if simplejpeg is not None:
        array = simplejpeg.decode_jpeg(
            view,
            colorspace="RGB",
            min_height=math.ceil(frame.height / d),
            min_width=math.ceil(frame.width / d),
            min_factor=d,  # with the minimum sizes: exactly 1/d
        )
    else:
        with pil_opened(view) as image:  # PIL's own limit lifted: the checks above are the ones
            image.draft("RGB", (frame.width // d, frame.height // d))  # PIL takes the largest d fitting these
            array = np.asarray(image.convert("RGB"))
    writable = array if array.flags.writeable else array.copy()  # PIL's and simplejpeg's arrays may be read-only
    return torch.from_numpy(writable).permute(2, 0, 1)
