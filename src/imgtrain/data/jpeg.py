"""JPEG files as bytes, for dataset.decode=cuda: what workers hand over, and the checks they make first; and the
size an image's header may claim (dataset.max_image_pixels), which every decoding path checks before it decodes."""

from __future__ import annotations

import re
from typing import NamedTuple

import torch


class EncodedJpeg(NamedTuple):
    """One undecoded JPEG file: its bytes as a uint8 tensor, its path (named if the GPU cannot decode it), and the
    sample's augmentation seed (None where the sampler gives none: validation)."""

    data: torch.Tensor
    path: str
    seed: int | None = None
    orientation: int = 1  # EXIF's, from the header the worker checked: nvJPEG does not apply it, the GPU side does


class EncodedBatch(NamedTuple):
    """A batch of undecoded JPEGs as three tensors: one byte buffer (a worker hands over one shared-memory block,
    not one per file), each file's length in it, and each sample's augmentation seed, from which the GPU side
    draws its crop box and flip (data/batched.py): the same on a rerun and on a resume."""

    data: torch.Tensor  # uint8 [total bytes]
    lengths: torch.Tensor  # int64 [B]
    seeds: torch.Tensor  # int64 [B]
    orientations: torch.Tensor | None = None  # int64 [B]: EXIF's (1: as stored); None: all as stored

    @classmethod
    def pack(
        cls, files: list[torch.Tensor], seeds: list[int | None] | None = None, orientations: list[int] | None = None
    ) -> EncodedBatch:
        """Files (1-d uint8 tensors), their seeds (a missing seed is the sample's position) and EXIF orientations."""
        seeds = [i if s is None else s for i, s in enumerate(seeds or [None] * len(files))]
        data = torch.cat(files) if files else torch.empty(0, dtype=torch.uint8)
        turned = orientations is not None and any(o != 1 for o in orientations)
        return cls(
            data,
            torch.tensor([f.numel() for f in files], dtype=torch.int64),
            torch.tensor(seeds),
            torch.tensor(orientations, dtype=torch.int64) if turned else None,
        )

    @property
    def count(self) -> int:
        return int(self.lengths.numel())

    def files(self) -> list[torch.Tensor]:
        """Each file's bytes: views into the buffer."""
        return list(torch.split(self.data, self.lengths.tolist())) if self.count else []


# Start-of-frame markers (baseline, extended, progressive, lossless; Huffman or arithmetic coded).
_SOF_MARKERS = frozenset({0xC0, 0xC1, 0xC2, 0xC3, 0xC5, 0xC6, 0xC7, 0xC9, 0xCA, 0xCB, 0xCD, 0xCE, 0xCF})
_PROGRESSIVE = frozenset({0xC2, 0xC6, 0xCA, 0xCE})  # of those, the progressive ones
_START_OF_SCAN, _END_OF_IMAGE = 0xDA, b"\xff\xd9"
JPEG_MAGIC = b"\xff\xd8\xff"  # a JPEG's first bytes: the start-of-image marker, then another marker
_APP1, _ORIENTATION_TAG = 0xE1, 0x0112  # the segment EXIF is stored in, and its orientation's tag
_SKIPPED = frozenset({*range(0xE0, 0xF0), 0xFE, 0xDC})  # APPn, COM, DNL: segments libjpeg skips by their length
# A marker's code: a byte other than 0x00 and 0xFF right after a 0xFF. The first one after a position is where
# libjpeg finds the next marker (jdmarker.c, next_marker: bytes other than 0xFF skipped, then 0xFF fill bytes; a
# stuffed zero, FF 00, skipped as data), found here by the regex engine in one pass, in C.
_MARKER_CODE = re.compile(rb"[^\x00\xff](?<=\xff[^\x00\xff])")  # the code first: a faster scan than the 0xFF first
# Markers read before the first scan at most. Real files carry a few dozen (an ICC profile split over up to 255
# APP2 segments among them); the bound keeps a header of millions of two-byte markers from costing seconds here.
MAX_MARKERS = 4096
_TRUNCATED = "truncated JPEG (the header ends before the image data)"


class JpegFrame(NamedTuple):
    """What a JPEG's markers say before its first scan: its size, its channels, and where its image data starts."""

    width: int
    height: int
    components: int | None
    data_start: int  # the first byte after the first start-of-scan header
    orientation: int = 1  # EXIF's (1-8; 1: stored upright): how the stored pixels turn to be shown upright
    # Progressive, or a first scan without every component: libjpeg then keeps the whole image's DCT coefficients
    # (2 bytes per sample: about 3 bytes a pixel at 4:2:0) until the last scan, at any output scale
    held_whole: bool = False

    @property
    def upright_size(self) -> tuple[int, int]:
        """(height, width) once turned upright: EXIF orientations 5-8 swap the sides."""
        return (self.width, self.height) if self.orientation >= 5 else (self.height, self.width)


def jpeg_header(data: bytes | bytearray | memoryview) -> JpegFrame | None:
    """The frame header of a file that starts as a JPEG does (its start-of-image marker and a marker after it),
    when its markers read; None for any other file, and for a JPEG whose markers do not (its decoder then says why)."""
    frame = jpeg_frame(data) if bytes(data[:3]) == JPEG_MAGIC else None
    return frame if isinstance(frame, JpegFrame) else None


def too_many_pixels(width: int, height: int, max_pixels: int | None) -> str | None:
    """Why an image of `width` x `height` (as its header says) is not decoded; None within `max_pixels` (None: no
    limit). Any file's header, not only a JPEG's: the CPU decoders and decode=cuda refuse with the same line."""
    if max_pixels is None or width * height <= max_pixels:
        return None
    megapixels = width * height / 1e6
    shown = f"{megapixels:,.0f}" if megapixels >= 100 else f"{megapixels:.3g}"
    return f"{width}x{height} pixels ({shown} MP) is above dataset.max_image_pixels={max_pixels}"


def jpeg_frame(data: bytes | bytearray | memoryview) -> JpegFrame | str:
    """The frame header of a JPEG, read from its markers alone up to the first scan, as libjpeg reads them; or why
    they cannot be read. Never raises; reads at most MAX_MARKERS markers (the bytes between them are skipped in C)."""
    if len(data) < 4 or data[0] != 0xFF or data[1] != 0xD8:  # the start-of-image marker
        return "not a JPEG file (dataset.decode=cuda decodes JPEG only)"
    pos, frame, orientation, app1_seen = 2, None, 1, False
    for _ in range(MAX_MARKERS):
        found = _MARKER_CODE.search(data, pos + 1)  # its 0xFF at pos or after
        if found is None:
            return _TRUNCATED
        pos, marker = found.start() - 1, data[found.start()]  # pos: the marker's 0xFF
        if marker == 0x01 or 0xD0 <= marker <= 0xD7:  # markers without a length field
            pos += 2
            continue
        if pos + 4 > len(data):
            return _TRUNCATED
        length = (data[pos + 2] << 8) | data[pos + 3]
        bogus = length < 2 and marker in _SKIPPED  # libjpeg reads its length, skips nothing and saves nothing
        end = pos + 4 if bogus else pos + 2 + length
        if length < 2 and not bogus:
            return f"damaged JPEG header (a segment of {length} bytes)"
        if end > len(data):
            return _TRUNCATED
        if marker in _SOF_MARKERS and frame is None and length >= 8:  # precision, height, width, channels
            size = ((data[pos + 7] << 8) | data[pos + 8], (data[pos + 5] << 8) | data[pos + 6])
            frame = (*size, data[pos + 9], marker in _PROGRESSIVE)
        elif marker == _APP1 and not app1_seen and not bogus:  # the first APP1 alone, as TorchCodec reads it
            app1_seen, orientation = True, exif_orientation(data[pos + 4 : end]) or 1
        elif marker == _START_OF_SCAN:
            if frame is None:
                return "damaged JPEG header (no frame header before the image data)"
            in_scan = data[pos + 4] if length > 2 else 0  # the first scan's components
            held = frame[3] or in_scan < frame[2]
            return JpegFrame(*frame[:3], data_start=end, orientation=orientation, held_whole=held)
        pos = end
    return f"damaged JPEG header (more than {MAX_MARKERS} markers before the image data)"


def exif_orientation(segment: bytes | bytearray | memoryview) -> int | None:
    """The orientation (1-8) in an APP1 segment's payload, read as TorchCodec and torchvision read it (their
    Exif.h, from OpenCV), so that every path turns a file as its full decode does; None when it gives none (then
    the image is taken as stored: 1). Their reading: the payload's first 6 bytes skipped unread (b"Exif\\0\\0" is
    not checked: an XMP packet in the first APP1 gives no orientation, whatever a later APP1 says), "II" little-
    endian and anything else big-endian, TIFF's magic 42 required, then IFD0's 12-byte entries (tag, type, count,
    value) up to the orientation's tag, whose first 16 bits are taken whatever its type; a tag read past the end (or
    0xFFFF) ends the search. Offsets wrap at 32 bits, as theirs do. Never raises."""
    tiff = bytes(segment[6:]) if len(segment) > 6 else b""
    order = "little" if tiff[:2] == b"II" else "big"

    def number(offset: int, size: int) -> int:  # 0xFFFF past the end: their INCORRECT_TAG
        offset &= 0xFFFFFFFF
        return int.from_bytes(tiff[offset : offset + size], order) if offset + size <= len(tiff) else 0xFFFF

    if number(2, 2) != 42:
        return None
    offset = number(4, 4)
    for entry in range(number(offset, 2)):  # at most 65535 entries
        offset += 12 if entry else 2  # the first entry after the count, then one every 12 bytes
        tag = number(offset, 2)
        if tag == 0xFFFF:
            break
        if tag == _ORIENTATION_TAG:
            value = number(offset + 8, 2)
            return value if 1 <= value <= 8 else None
    return None


def checked_frame(data: bytes | bytearray, max_pixels: int | None = None) -> JpegFrame | str:
    """The frame header of a JPEG the GPU decoder may be given, or why it should not be, read from its markers
    alone.

    Catches what the CPU decoder rejects but nvJPEG might not report: files cut short (no end-of-image marker
    after the first scan; an EXIF thumbnail's marker comes before it), 4-channel (CMYK/YCCK) JPEGs, and a frame
    above `max_pixels` (dataset.max_image_pixels), which nvJPEG would allocate whatever the file holds.
    """
    frame = jpeg_frame(data)
    if isinstance(frame, str):
        return frame
    if frame.components not in (1, 3):
        return (
            f"a {frame.components}-channel (CMYK/YCCK) JPEG, which the GPU decoder cannot read: convert it to RGB "
            "or use dataset.decode=cpu"
        )
    too_large = too_many_pixels(frame.width, frame.height, max_pixels)
    if too_large:
        return f"{too_large}; not decoded"
    if data.find(_END_OF_IMAGE, frame.data_start) < 0:
        return "truncated JPEG (no end-of-image marker)"
    return frame
