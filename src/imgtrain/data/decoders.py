"""Image files to uint8 RGB tensors on the CPU: TorchCodec where it loads, torchvision's own decoders where it does
not and torchvision still supports them, PIL for the formats neither decodes.

TorchCodec is imported when something first decodes, never by importing this module: a run that decodes nothing
on the CPU (synthetic data, CIFAR, dataset.decode=cuda) does not need it, and its wheels load only with the torch
they were built for. torchvision 0.29 deprecates its decoders for TorchCodec's, so from 0.29 on a TorchCodec that
does not load ends the run in one line (`check`); before 0.29 the run decodes with torchvision.io and says so once.
"""

from __future__ import annotations

import importlib
import io
import logging
import re
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
import torchvision
from PIL import Image, UnidentifiedImageError

from imgtrain.host.optional import LOAD_ERRORS
from imgtrain.resilience.errors import ConfigError, first_line

log = logging.getLogger(__name__)

# What a decoder raises on a file that is not a readable image (truncated, garbage, an unknown format).
DECODE_ERRORS = (OSError, RuntimeError, ValueError, SyntaxError, Image.DecompressionBombError)
# TorchCodec's and torchvision's C++ errors start with the throwing function and its source file on their build
# machine.
_SOURCE_LOCATION = re.compile(r"^\w+, \S+:\d+, ")
TORCHVISION_DECODERS_DEPRECATED = (0, 29)  # torchvision.io's image decoders are deprecated from this release on
# The formats torchvision.io.decode_image reads, by their first bytes (its own check raises the RuntimeError it
# also raises for a damaged file): JPEG, PNG, GIF, WebP.
_TORCHVISION_MAGIC = (b"\xff\xd8\xff", b"\x89PNG\r\n\x1a\n", b"GIF87a", b"GIF89a")


@dataclass(frozen=True)
class CpuDecoder:
    """The decoder this process uses: `decode(bytes)` -> uint8 [3, H, W] (or [N, 3, H, W] for an animation), raising
    ValueError for a format it does not read (PIL reads those)."""

    name: str
    decode: Callable[[torch.Tensor], torch.Tensor]
    fallback_reason: str | None = None  # why TorchCodec is not the one (None when it is)


_chosen: CpuDecoder | None = None  # per process: DataLoader workers choose again, and the same


def torchvision_version() -> tuple[int, int]:
    major, minor = re.match(r"(\d+)\.(\d+)", torchvision.__version__).groups()
    return int(major), int(minor)


def _torchcodec() -> CpuDecoder:
    decoders = importlib.import_module("torchcodec.decoders")
    return CpuDecoder("torchcodec", lambda data: decoders.decode_image(data, mode="RGB"))


def _torchvision(reason: str) -> CpuDecoder:
    from_io = importlib.import_module("torchvision.io")

    def decode(data: torch.Tensor) -> torch.Tensor:
        head = data[:12].numpy().tobytes()
        if not (head.startswith(_TORCHVISION_MAGIC) or (head[:4] == b"RIFF" and head[8:12] == b"WEBP")):
            raise ValueError("not a format torchvision.io decodes")
        return from_io.decode_image(data, mode=from_io.ImageReadMode.RGB)

    return CpuDecoder(f"torchvision.io {torchvision.__version__}", decode, reason)


def cpu_decoder(needed_by: str = "decoding images on the CPU", alternative: str = "") -> CpuDecoder:
    """TorchCodec's decoder, or torchvision's where TorchCodec does not load and torchvision < 0.29; else a
    ConfigError naming TorchCodec, what needs it (`needed_by`) and the fix (or `alternative`, e.g. "use
    dataset.decode=cuda")."""
    global _chosen
    if _chosen is None:
        try:
            _chosen = _torchcodec()
        except LOAD_ERRORS as error:
            if torchvision_version() >= TORCHVISION_DECODERS_DEPRECATED:
                torch_release = torch.__version__.split("+")[0]
                raise ConfigError(
                    f"{needed_by} needs TorchCodec, which cannot be imported here ({first_line(error)}), and "
                    f"torchvision {torchvision.__version__} deprecates its own decoders: pip install "
                    f"'torchcodec>=0.16' built for torch {torch_release} (TorchCodec's compatibility table)"
                    + (f", or {alternative}" if alternative else "")
                ) from error
            _chosen = _torchvision(first_line(error))
    return _chosen


def check(needed_by: str, alternative: str = "") -> CpuDecoder:
    """Choose the decoder before any worker starts (one line if there is none, see `cpu_decoder`), and say once
    when it is not TorchCodec. `needed_by`: what decodes (e.g. "dataset=shapes"), for both lines."""
    fallback = _chosen is None
    decoder = cpu_decoder(needed_by, alternative)
    if fallback and decoder.fallback_reason is not None:
        log.warning(
            "%s decodes images with %s: TorchCodec cannot be imported here (%s)",
            *(needed_by, decoder.name, decoder.fallback_reason),
        )
    return decoder


def describe() -> str:
    """The decoder in use, for metrics.json's environment."""
    return f"{cpu_decoder().name} (JPEG, PNG, WebP, GIF); PIL for other formats"


def read_file(path: str) -> torch.Tensor:
    """A file's bytes as a 1-d uint8 tensor."""
    with open(path, "rb") as f:
        return torch.frombuffer(bytearray(f.read()), dtype=torch.uint8)


def decode_file(path: str) -> torch.Tensor:
    """Read and decode an image file into a uint8 RGB tensor [3, H, W]."""
    return decode_bytes(read_file(path), path)


def error_reason(error: BaseException) -> str:
    """The first line of an exception's message, or its type's name."""
    if isinstance(error, UnidentifiedImageError):  # PIL's message names an in-memory file object
        return "not an image in a format Pillow or TorchCodec can read (damaged, or another kind of file)"
    text = _SOURCE_LOCATION.sub("", str(error).strip())
    return text.splitlines()[0] if text else type(error).__name__


def decode_problem(data: bytes, path: str) -> str | None:
    """Why `data` (the bytes of the image file `path`) cannot be decoded the way training decodes it; None if it
    can. What the converter checks before packing a file."""
    try:
        decode_bytes(torch.frombuffer(bytearray(data), dtype=torch.uint8), path)
    except DECODE_ERRORS as error:
        return error_reason(error)
    return None


def decode_bytes(data: torch.Tensor, path: str) -> torch.Tensor:
    """An image file's bytes as a uint8 RGB tensor [3, H, W]: the CPU decoder (TorchCodec: libjpeg-turbo, libpng,
    libwebp) for JPEG, PNG, WebP and GIF, PIL for the other formats (from the same bytes, so images packed in shards
    decode the same way; `path` names the image in errors). A damaged JPEG or PNG raises the decoder's error."""
    try:
        image = cpu_decoder().decode(data)
    except ValueError:  # a format the decoder does not read (BMP, TIFF, PPM, ...): its check of the magic bytes
        return _decode_with_pil(data)
    return image[0] if image.ndim == 4 else image  # an animated GIF or WebP: its first frame, as PIL gives


def _decode_with_pil(data: torch.Tensor) -> torch.Tensor:
    with Image.open(io.BytesIO(data.numpy().tobytes())) as img:
        array = np.asarray(img.convert("RGB"), dtype=np.uint8)
    return torch.from_numpy(array.copy()).permute(2, 0, 1)
