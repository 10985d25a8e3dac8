"""`imgtrain-shards --max-side N`: an image whose longer side exceeds N pixels is packed downscaled to N, upright, as
a JPEG; any other is packed as its file's bytes, unchanged.

Why: the CPU decodes a 12-MP phone photo at about 15 images/s per core against about 1,200/s for an ImageNet-sized
JPEG (BENCHMARKS.md, 2026-11-27 09:38), and training crops 224 px out of it anyway. Downscaling once, here, in the
converter's worker processes, saves that decode on every epoch of every run.

Pixels: PIL decodes the file (a JPEG at 1/2, 1/4 or 1/8 scale where that still leaves at least twice the target,
as Pillow's own `thumbnail` does: 1.9x the full decode's rate on 12-MP photos in that benchmark), converts it to
8-bit RGB as training's decoder does (16-bit samples scaled by `decoders.to_uint8`, not clipped; alpha dropped),
resizes it with Lanczos so that the longer side is N, and turns it upright by its EXIF orientation
(`ImageOps.exif_transpose`), a JPEG's read as training's decoder reads it (data/jpeg.py: where PIL reads another
APP1 segment than TorchCodec, TorchCodec's). The result is a baseline 8-bit RGB JPEG (`QUALITY`, `SUBSAMPLING`)
without metadata: a PNG, WebP or CMYK JPEG above N comes out as one too, which `dataset.decode=cuda` reads.
"""

from __future__ import annotations

import io
from dataclasses import dataclass

import numpy as np
from PIL import ExifTags, Image, ImageMode, ImageOps

from imgtrain.config.datasets import MAX_IMAGE_PIXELS
from imgtrain.data.decoders import pil_guard, pil_orientation, to_uint8
from imgtrain.data.jpeg import jpeg_header

# JPEG quality of a downscaled image (libjpeg's 1-100 scale; --max-side-quality's default): a high setting, so the
# artefacts of this second encoding stay small next to what augmentation changes (benchmarks/photos.py writes its
# photo-like files at the same quality).
QUALITY = 90
# Chroma at half resolution both ways: what cameras, ImageNet's files and libjpeg's default use (4:4:4 would keep
# one-pixel colour edges, at more bytes to store and decode).
SUBSAMPLING = "4:2:0"
# A JPEG is decoded at a reduced scale only while that leaves at least this many times the target size (Pillow's
# `thumbnail` default): the Lanczos filter then still has the pixels it averages over.
_DRAFT_GAP = 2


@dataclass(frozen=True)
class MaxSide:
    """What `--max-side` asks for: `side` None packs every image as its bytes."""

    side: int | None = None
    quality: int = QUALITY

    @property
    def packing(self) -> dict[str, int | None]:
        """As the manifest and the partial file record it: a conversion packed otherwise is redone, not kept."""
        return {"max_side": self.side, "max_side_quality": None if self.side is None else self.quality}

    def shrunk(self, data: bytes, max_pixels: int | None = MAX_IMAGE_PIXELS) -> bytes | None:
        """`data` (an image file's bytes) as the JPEG bytes to store, or None when its longer side is at most `side`
        (it is stored as it is). Raises what PIL raises on an image it cannot read (decoders.DECODE_ERRORS)."""
        if self.side is None:
            return None
        with pil_guard(max_pixels), Image.open(io.BytesIO(data)) as image:
            if max(image.size) <= self.side:
                return None
            frame = jpeg_header(data)  # a JPEG turns as training's decoder turns it (jpeg.exif_orientation)
            return downscaled(image, self.side, self.quality, frame.orientation if frame else None)


AS_STORED = MaxSide()  # no --max-side: every image packed as its file's bytes


def target_size(width: int, height: int, side: int) -> tuple[int, int]:
    """`width` x `height` scaled so that the longer side is `side`: the other rounded to the nearest pixel (halves
    up), at least 1."""
    longer = max(width, height)

    def scaled(length: int) -> int:
        return side if length == longer else max(1, (2 * length * side + longer) // (2 * longer))

    return scaled(width), scaled(height)


def downscaled(image: Image.Image, side: int, quality: int = QUALITY, orientation: int | None = None) -> bytes:
    """`image` (opened, not yet decoded) with its longer side `side`, upright, as JPEG bytes: turned by
    `orientation` (EXIF's, 1-8), or where None by the one PIL reads."""
    orientation = pil_orientation(image) if orientation is None else orientation
    size = target_size(*image.size, side)  # in the stored orientation: a transposition swaps it, keeping `side`
    drafted = image.draft("RGB", (size[0] * _DRAFT_GAP, size[1] * _DRAFT_GAP))  # JPEG only; else None
    box = drafted[1] if drafted else None  # the original's extent in the reduced image (its last pixel may be part)
    rgb = _rgb(image)
    # Lanczos (a windowed sinc, 3 lobes) is antialiased: every source pixel under its support is averaged in, so
    # fine detail above the new Nyquist frequency is filtered out instead of aliasing into moire, as nearest or a
    # plain bilinear sample of a 4,000-px photo would. It is also what torchvision's antialiased resize approximates.
    small = rgb.resize(size, Image.Resampling.LANCZOS, box=box)
    small.info = {}  # no metadata is stored (the EXIF block, its thumbnail, ICC, XMP): the pixels are upright
    small.getexif()[ExifTags.Base.Orientation] = orientation  # the original's, for exif_transpose below
    upright = ImageOps.exif_transpose(small)  # as training's decoder turns an image kept as its bytes
    out = io.BytesIO()
    upright.save(out, "JPEG", quality=quality, subsampling=SUBSAMPLING, progressive=False)  # baseline: nvJPEG's path
    return out.getvalue()


def _rgb(image: Image.Image) -> Image.Image:
    """`image` in 8-bit RGB, in its stored orientation: a mode of more than 8 bits a channel (16-bit gray, PIL's I
    and F) scaled to 0..255 as training's decoder scales it (PIL's convert would clip it: a 16-bit gradient comes
    out white), any other converted by PIL (alpha dropped, as training's decoder drops it)."""
    if ImageMode.getmode(image.mode).typestr not in ("|u1", "|b1"):  # not 8-bit or 1-bit samples
        return Image.fromarray(to_uint8(np.asarray(image))).convert("RGB")
    return image if image.mode == "RGB" else image.convert("RGB")
