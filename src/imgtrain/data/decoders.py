"""Image files to uint8 RGB tensors on the CPU: TorchCodec where it loads, torchvision's own decoders where it does
not and torchvision still supports them, PIL for the formats neither decodes.

TorchCodec is imported when something first decodes, never by importing this module: a run that decodes nothing
on the CPU (synthetic data, CIFAR, dataset.decode=cuda) does not need it, and its wheels load only with the torch
they were built for. torchvision 0.29 deprecates its decoders for TorchCodec's, so from 0.29 on a TorchCodec that
does not load ends the run in one line (`check`); before 0.29 the run decodes with torchvision.io and says so once.
"""

from __future__ import annotations

import contextlib
import importlib
import io
import logging
import re
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import numpy as np
import torch
import torchvision
from PIL import Image, UnidentifiedImageError

from imgtrain.common.errors import ConfigError, first_line
from imgtrain.config.datasets import MAX_IMAGE_PIXELS
from imgtrain.data.jpeg import JPEG_MAGIC, JpegFrame, jpeg_frame, jpeg_header, too_many_pixels
from imgtrain.data.reads import read_bytes
from imgtrain.host.optional import LOAD_ERRORS

log = logging.getLogger(__name__)


class OversizedImage(Exception):
    """An image whose header claims more pixels than dataset.max_image_pixels: refused before anything decodes it."""


# What a decoder raises on a file that is not a readable image (truncated, garbage, an unknown format, too large).
DECODE_ERRORS = (OSError, RuntimeError, ValueError, SyntaxError, Image.DecompressionBombError, OversizedImage)
# PIL's modes of more than 8 bits a channel: 16-bit gray (I;16 and its byte orders), 32-bit integers (I, where PIL's
# PNG, PGM and TIFF readers put 16-bit samples too) and 32-bit floats (F). PIL's convert("RGB") clips them to 255.
_DEEP_MODES = frozenset({"I;16", "I;16B", "I;16L", "I;16N", "I", "F"})
# PIL's message when Image.open refuses an image for its size (DecompressionBombWarning or DecompressionBombError)
_PIL_BOMB = re.compile(r"Image size \((\d+) pixels\)")
# TorchCodec's and torchvision's C++ errors start with the throwing function and its source file on their build
# machine.
_SOURCE_LOCATION = re.compile(r"^\w+, \S+:\d+, ")
TORCHVISION_DECODERS_DEPRECATED = (0, 29)  # torchvision.io's image decoders are deprecated from this release on
# The formats torchvision.io.decode_image reads, by their first bytes (its own check raises the RuntimeError it
# also raises for a damaged file): JPEG, PNG, GIF, WebP.
_TORCHVISION_MAGIC = (JPEG_MAGIC, b"\x89PNG\r\n\x1a\n", b"GIF87a", b"GIF89a")
_ORIENTATION_TAG = 0x0112  # EXIF's
# An ISO-BMFF file's brands (bytes 8-12, after "ftyp") that phones write for HEVC-coded stills (HEIC, Apple's
# default); not the generic mif1 and msf1, which AVIF files (read by Pillow) may carry too
_HEIF_BRANDS = frozenset({b"heic", b"heix", b"heim", b"heis", b"hevc", b"hevx", b"hevm", b"hevs"})
_TURNS: dict[int, Callable[[torch.Tensor], torch.Tensor]] = {  # what EXIF orientation 2-8 asks of [..., H, W]
    2: lambda x: x.flip(-1),
    3: lambda x: x.flip(-1, -2),
    4: lambda x: x.flip(-2),
    5: lambda x: x.transpose(-1, -2),
    6: lambda x: torch.rot90(x, -1, (-2, -1)),
    7: lambda x: x.flip(-1, -2).transpose(-1, -2),
    8: lambda x: torch.rot90(x, 1, (-2, -1)),
}


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
        return from_io.decode_image(data, mode=from_io.ImageReadMode.RGB, apply_exif_orientation=True)

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


def read_file(path: str, max_pixels: int | None = MAX_IMAGE_PIXELS) -> torch.Tensor:
    """An image file's bytes as a 1-d uint8 tensor, read as reads.read_bytes reads it: a regular file only, at most
    its size and the cap `max_pixels` (dataset.max_image_pixels) sets; an OSError (UnreadableFile) otherwise."""
    return torch.frombuffer(read_bytes(path, max_pixels), dtype=torch.uint8)


def decode_file(path: str, max_pixels: int | None = MAX_IMAGE_PIXELS) -> torch.Tensor:
    """Read and decode an image file into a uint8 RGB tensor [3, H, W]."""
    return decode_bytes(read_file(path, max_pixels), path, max_pixels)


def error_reason(error: BaseException) -> str:
    """The first line of an exception's message, or its type's name."""
    if isinstance(error, UnidentifiedImageError):  # PIL's message names an in-memory file object
        return "not an image in a format Pillow or TorchCodec can read (damaged, or another kind of file)"
    text = _SOURCE_LOCATION.sub("", str(error).strip())
    return text.splitlines()[0] if text else type(error).__name__


def decode_problem(data: bytes, path: str, max_pixels: int | None = MAX_IMAGE_PIXELS) -> str | None:
    """Why `data` (the bytes of the image file `path`) cannot be decoded the way training decodes it (with
    `max_pixels` as dataset.max_image_pixels); None if it can. What the converter checks before packing a file."""
    try:
        decode_bytes(torch.frombuffer(bytearray(data), dtype=torch.uint8), path, max_pixels)
    except DECODE_ERRORS as error:
        return error_reason(error)
    return None


def decode_bytes(data: torch.Tensor, path: str, max_pixels: int | None = MAX_IMAGE_PIXELS) -> torch.Tensor:
    """An image file's bytes as a uint8 RGB tensor [3, H, W]: the CPU decoder (TorchCodec: libjpeg-turbo, libpng,
    libwebp) for JPEG, PNG, WebP and GIF, PIL for the other formats (from the same bytes, so images packed in shards
    decode the same way; `path` names the image in errors). A damaged JPEG or PNG raises the decoder's error.

    The header is read first (a JPEG's markers, data/jpeg.py; PIL's lazy open for the rest), and an image above
    `max_pixels` (dataset.max_image_pixels; None: no limit) raises OversizedImage without being decoded: a decoder
    believes what a header claims, 60000 x 60000 in 333 bytes included."""
    view = memoryview(data.numpy())
    frame = jpeg_header(view)
    if frame is not None:  # its frame header, found without PIL
        return decode_jpeg(data, frame, max_pixels)
    if bytes(view[:3]) == JPEG_MAGIC:  # a JPEG whose markers libjpeg would not read either: why, in one line
        raise ValueError(jpeg_frame(view))
    if view[4:8] == b"ftyp" and bytes(view[8:12]) in _HEIF_BRANDS:
        raise ValueError(
            f"a HEIC/HEIF image (brand {bytes(view[8:12]).decode()}), which neither TorchCodec nor Pillow decodes: "
            "convert it to JPEG first (e.g. `heif-convert`, or Pillow with the pillow-heif plugin)"
        )
    with pil_opened(view) as image:  # PIL reads the header only, until the pixels are asked for
        _check_size(*image.size, max_pixels)
        return _decoded(data, image)


def decode_jpeg(data: torch.Tensor, frame: JpegFrame, max_pixels: int | None = MAX_IMAGE_PIXELS) -> torch.Tensor:
    """A JPEG's bytes whose frame header is read (`jpeg.jpeg_header`) decoded in full, as `decode_bytes` does:
    refused above `max_pixels` without being decoded."""
    _check_size(frame.width, frame.height, max_pixels)
    return _decoded(data, None)


def _check_size(width: int, height: int, max_pixels: int | None) -> None:
    too_large = too_many_pixels(width, height, max_pixels)
    if too_large:
        raise OversizedImage(f"{too_large}; not decoded")


def _decoded(data: torch.Tensor, opened: Image.Image | None) -> torch.Tensor:
    """The CPU decoder's image, or PIL's (`opened`, or opened here) for a format the decoder does not read."""
    try:
        image = cpu_decoder().decode(data)
    except ValueError:  # a format the decoder does not read (BMP, TIFF, PPM, ...): its check of the magic bytes
        if opened is not None:
            return pil_rgb(opened)
        with pil_opened(memoryview(data.numpy())) as reopened:
            return pil_rgb(reopened)
    return image[0] if image.ndim == 4 else image  # an animated GIF or WebP: its first frame, as PIL gives


@contextlib.contextmanager
def pil_opened(data: bytes | memoryview) -> Iterator[Image.Image]:
    """PIL's lazy image of an image file's bytes, PIL's own guard lifted: the caller checks the size against
    dataset.max_image_pixels, the one limit (PIL's own, 89 MP, would refuse or warn about what the key allows,
    or what is decoded at a reduced scale)."""
    with pil_guard(None), Image.open(io.BytesIO(data)) as image:
        yield image


@contextlib.contextmanager
def pil_guard(max_pixels: int | None) -> Iterator[None]:
    """PIL's own guard at `max_pixels` (dataset.max_image_pixels) for the block, for the images a user's Dataset
    opens itself: Image.open refuses one above it before decoding anything, and OversizedImage says so (PIL warns
    above its Image.MAX_IMAGE_PIXELS, raised here as an error; its own error comes only at twice that). None lifts
    the guard. PIL's setting is one global, put back after the block; a block runs in one thread of its process
    (a DataLoader worker, or the training process with data.num_workers=0)."""
    previous = Image.MAX_IMAGE_PIXELS
    Image.MAX_IMAGE_PIXELS = max_pixels
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            yield
    except (Image.DecompressionBombWarning, Image.DecompressionBombError) as error:
        found = _PIL_BOMB.search(str(error))
        size = f"{int(found[1])} pixels" if found else error_reason(error)
        raise OversizedImage(
            f"{size} is above dataset.max_image_pixels={max_pixels} (PIL's Image.open refused it); not decoded"
        ) from None
    finally:
        Image.MAX_IMAGE_PIXELS = previous


def pil_rgb(image: Image.Image) -> torch.Tensor:
    """A PIL image as uint8 RGB [3, H, W]: a mode of more than 8 bits a channel scaled by `to_uint8` (PIL's
    convert would clip it to 255: a 16-bit gradient comes out white), any other converted by PIL."""
    if image.mode in _DEEP_MODES:
        levels = torch.from_numpy(to_uint8(np.asarray(image)))
        return upright(levels.expand(3, *levels.shape).contiguous(), pil_orientation(image))
    array = np.asarray(image if image.mode == "RGB" else image.convert("RGB"), dtype=np.uint8)
    return upright(torch.from_numpy(array.copy()).permute(2, 0, 1), pil_orientation(image))


def pil_orientation(image: Image.Image) -> int:
    """The EXIF orientation (1-8) a PIL image carries (a TIFF's, WebP's or PNG's, or a JPEG from a user's code),
    read from the opened file (PIL keeps a TIFF's outside `info`, and images made from it do not share it); 1, the
    pixels as stored, for a damaged EXIF block or another value."""
    try:
        value = image.getexif().get(_ORIENTATION_TAG, 1)
    except (OSError, ValueError, SyntaxError):  # a damaged EXIF block: the pixels as stored
        return 1
    return value if isinstance(value, int) and 1 <= value <= 8 else 1


def upright(image: torch.Tensor, orientation: int) -> torch.Tensor:
    """uint8 [3, H, W] as stored with EXIF `orientation` (1-8), turned as a viewer shows it (PIL's
    ImageOps.exif_transpose; TorchCodec's decoder does the same for JPEGs): mirrored (2, 4), turned by 180 (3),
    90 clockwise (6) or counter-clockwise (8), or transposed along either diagonal (5, 7)."""
    turn = _TURNS.get(orientation)
    return image if turn is None else turn(image).contiguous()


def to_uint8(values: np.ndarray) -> np.ndarray:
    """Pixel values as uint8, scaled by their type's range as libpng (TorchCodec) scales a 16-bit PNG: a 16-bit
    value v (and a 32-bit integer one, PIL's I mode) as round(v / 257), a float f in 0..1 (torchvision's convention)
    as round(f * 255). Values outside that range are a ValueError (an unreadable image), not a saturated one."""
    if values.dtype == np.uint8:
        return values
    if values.dtype.kind not in "uif" or values.size == 0:
        raise ValueError(f"{values.dtype} pixels {list(values.shape)}: expected uint8, 16-bit or float values")
    low, high = values.min().item(), values.max().item()
    if values.dtype.kind == "f":
        if not (low >= 0 and high <= 1):  # NaN fails both
            raise ValueError(f"float pixels from {low:g} to {high:g}, outside the 0..1 a float image is read in")
        return np.rint(values * 255).astype(np.uint8)
    if low < 0 or high > 65535:
        raise ValueError(f"integer pixels from {low} to {high}, outside the 0..65535 a 16-bit image is read in")
    return ((values.astype(np.uint32) + 128) // 257).astype(np.uint8)
