"""JPEG files as bytes, for dataset.decode=cuda: what workers hand over, and the checks they make first; and the
size an image's header may claim (dataset.max_image_pixels), which every decoding path checks before it decodes."""

from __future__ import annotations

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
_START_OF_SCAN, _END_OF_IMAGE = 0xDA, b"\xff\xd9"
JPEG_MAGIC = b"\xff\xd8\xff"  # a JPEG's first bytes: the start-of-image marker, then another marker
_APP1, _EXIF, _ORIENTATION_TAG = 0xE1, b"Exif\x00\x00", 0x0112  # the EXIF segment, and its orientation's tag


class JpegFrame(NamedTuple):
    """What a JPEG's markers say before its first scan: its size, its channels, and where its image data starts."""

    width: int
    height: int
    components: int | None
    data_start: int  # the first byte after the first start-of-scan header
    orientation: int = 1  # EXIF's (1-8; 1: stored upright): how the stored pixels turn to be shown upright

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
    """The frame header of a JPEG, read from its markers alone up to the first scan; or why they cannot be read."""
    if len(data) < 4 or data[0] != 0xFF or data[1] != 0xD8:  # the start-of-image marker
        return "not a JPEG file (dataset.decode=cuda decodes JPEG only)"
    pos, frame, orientation = 2, None, None
    while pos + 4 <= len(data):
        if data[pos] != 0xFF:
            return "damaged JPEG header"
        marker = data[pos + 1]
        if marker == 0xFF:  # a fill byte before the marker
            pos += 1
            continue
        if marker == 0x01 or 0xD0 <= marker <= 0xD7:  # markers without a length field
            pos += 2
            continue
        length = (data[pos + 2] << 8) | data[pos + 3]
        if marker in _SOF_MARKERS and frame is None and pos + 9 < len(data):  # precision, height, width, channels
            frame = ((data[pos + 7] << 8) | data[pos + 8], (data[pos + 5] << 8) | data[pos + 6], data[pos + 9])
        if marker == _APP1 and orientation is None:
            orientation = exif_orientation(data[pos + 4 : pos + 2 + length])
        if marker == _START_OF_SCAN:
            if frame is None:
                return "damaged JPEG header (no frame header before the image data)"
            return JpegFrame(*frame, data_start=pos + 2 + length, orientation=orientation or 1)
        pos += 2 + length
    return "truncated JPEG (the header ends before the image data)"


def exif_orientation(segment: bytes | bytearray | memoryview) -> int | None:
    """The orientation (1-8) an APP1 segment's EXIF block gives in its first directory (IFD0: the main image's);
    None when the segment is not EXIF or says nothing valid (then the image is taken as stored: 1). TIFF's
    layout: a byte-order mark, the directory's offset, then 12-byte entries (tag, type, count, value)."""
    tiff = bytes(segment[6:]) if bytes(segment[:6]) == _EXIF else b""
    order = {b"II": "little", b"MM": "big"}.get(tiff[:2])
    if order is None or len(tiff) < 8:
        return None
    directory = int.from_bytes(tiff[4:8], order)
    count = int.from_bytes(tiff[directory : directory + 2], order) if directory + 2 <= len(tiff) else 0
    for entry in range(directory + 2, min(directory + 2 + 12 * count, len(tiff) - 11), 12):
        if int.from_bytes(tiff[entry : entry + 2], order) == _ORIENTATION_TAG:
            value = int.from_bytes(tiff[entry + 8 : entry + 10], order)  # a SHORT, left-justified in its field
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
