"""Image files the tests write byte by byte: what PIL cannot save (16-bit RGB PNG) and headers that lie about the
image's size (what the size check must catch before anything decodes it)."""

from __future__ import annotations

import io
import struct
import zlib

import numpy as np
from PIL import Image


def _chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))


def png_file(pixels: np.ndarray, claimed: tuple[int, int] | None = None) -> bytes:
    """A PNG of `pixels` (uint8 or uint16, [H, W] gray or [H, W, 3] RGB); `claimed` (width, height), if given, is
    what its header says instead: a header that lies over too few rows of data."""
    height, width = pixels.shape[:2]
    depth = 16 if pixels.dtype == np.uint16 else 8
    color = 2 if pixels.ndim == 3 else 0  # PNG's colour types: 2 RGB, 0 gray
    rows = b"".join(b"\0" + row.astype(">u2" if depth == 16 else np.uint8).tobytes() for row in pixels)
    shown = claimed or (width, height)
    header = struct.pack(">IIBBBBB", *shown, depth, color, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + _chunk(b"IHDR", header) + _chunk(b"IDAT", zlib.compress(rows)) + _chunk(b"IEND", b"")


def lying_jpeg(width: int, height: int) -> bytes:
    """A whole 16x16 JPEG (end-of-image marker and all) whose frame header claims `width` x `height`: libjpeg decodes
    it at the claimed size, the rest grey, with only "premature end of data segment" on stderr."""
    buffer = io.BytesIO()
    Image.fromarray(np.full((16, 16, 3), 90, np.uint8)).save(buffer, "JPEG")
    data = bytearray(buffer.getvalue())
    frame = data.find(b"\xff\xc0")  # baseline start of frame: length (2), precision (1), height (2), width (2)
    data[frame + 5 : frame + 9] = struct.pack(">HH", height, width)
    return bytes(data)
