"""JPEG files as bytes, for dataset.decode=cuda: what workers hand over, and the checks they make first."""

from __future__ import annotations

from typing import NamedTuple

import torch


class EncodedJpeg(NamedTuple):
    """One undecoded JPEG file: its bytes as a uint8 tensor, its path (named if the GPU cannot decode it), and the
    sample's augmentation seed (None where the sampler gives none: validation)."""

    data: torch.Tensor
    path: str
    seed: int | None = None


class EncodedBatch(NamedTuple):
    """A batch of undecoded JPEGs as three tensors: one byte buffer (a worker hands over one shared-memory block,
    not one per file), each file's length in it, and each sample's augmentation seed, from which the GPU side
    draws its crop box and flip (data/batched.py): the same on a rerun and on a resume."""

    data: torch.Tensor  # uint8 [total bytes]
    lengths: torch.Tensor  # int64 [B]
    seeds: torch.Tensor  # int64 [B]

    @classmethod
    def pack(cls, files: list[torch.Tensor], seeds: list[int | None] | None = None) -> EncodedBatch:
        """Files (1-d uint8 tensors) and their seeds (a missing seed is the sample's position)."""
        seeds = [i if s is None else s for i, s in enumerate(seeds or [None] * len(files))]
        data = torch.cat(files) if files else torch.empty(0, dtype=torch.uint8)
        return cls(data, torch.tensor([f.numel() for f in files], dtype=torch.int64), torch.tensor(seeds))

    @property
    def count(self) -> int:
        return int(self.lengths.numel())

    def files(self) -> list[torch.Tensor]:
        """Each file's bytes: views into the buffer."""
        return list(torch.split(self.data, self.lengths.tolist())) if self.count else []


# Start-of-frame markers (baseline, extended, progressive, lossless; Huffman or arithmetic coded).
_SOF_MARKERS = frozenset({0xC0, 0xC1, 0xC2, 0xC3, 0xC5, 0xC6, 0xC7, 0xC9, 0xCA, 0xCB, 0xCD, 0xCE, 0xCF})
_START_OF_SCAN, _END_OF_IMAGE = 0xDA, b"\xff\xd9"


def jpeg_problem(data: bytes | bytearray) -> str | None:
    """Why the GPU decoder should not be given this file, read from its markers alone; None if it looks whole.

    Catches what the CPU decoder rejects but nvJPEG might not report: files cut short (no end-of-image marker
    after the first scan; an EXIF thumbnail's marker comes before it), and 4-channel (CMYK/YCCK) JPEGs.
    """
    if len(data) < 4 or data[0] != 0xFF or data[1] != 0xD8:  # the start-of-image marker
        return "not a JPEG file (dataset.decode=cuda decodes JPEG only)"
    pos, components = 2, None
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
        if marker in _SOF_MARKERS and pos + 9 < len(data):
            components = data[pos + 9]
        if marker == _START_OF_SCAN:
            if components not in (1, 3):
                return (
                    f"a {components}-channel (CMYK/YCCK) JPEG, which the GPU decoder cannot read: convert it to RGB "
                    "or use dataset.decode=cpu"
                )
            if data.find(_END_OF_IMAGE, pos + 2 + length) < 0:
                return "truncated JPEG (no end-of-image marker)"
            return None
        pos += 2 + length
    return "truncated JPEG (the header ends before the image data)"
