"""Writes the JPEG seeds of tests/test_fuzz_jpeg.py into this folder: files made by real encoders (Pillow's
libjpeg-turbo; libjpeg-turbo's cjpeg where installed, for what Pillow cannot write) and crafted ones, each a
regression seed of a file that once cost more than its limits or turned two ways. Run it again to remake them:
`python tests/fuzz_seeds/jpeg/make_seeds.py` (the files are kept in the repository, so the tests need neither).
"""

from __future__ import annotations

import io
import shutil
import struct
import subprocess
import tempfile
from pathlib import Path

import numpy as np
from PIL import Image

HERE = Path(__file__).resolve().parent
ORIENTATION = 0x0112


def picture(width: int = 48, height: int = 32) -> Image.Image:
    """An asymmetric picture (gradients and a corner mark), so that each of the 8 EXIF turns gives other pixels."""
    y, x = np.mgrid[0:height, 0:width]
    rgb = np.stack([x * 255 // width, y * 255 // height, (x * y) % 256], axis=-1).astype(np.uint8)
    rgb[: height // 4, : width // 4] = (250, 20, 20)
    return Image.fromarray(rgb)


def encoded(image: Image.Image, **options: object) -> bytes:
    out = io.BytesIO()
    image.save(out, "JPEG", quality=90, **options)
    return out.getvalue()


def segment(marker: int, payload: bytes) -> bytes:
    return bytes([0xFF, marker]) + struct.pack(">H", len(payload) + 2) + payload


def tiff(orientation: int, order: bytes = b"MM", magic: int = 42, tags: tuple[int, ...] = (ORIENTATION,)) -> bytes:
    """A TIFF block with one directory at offset 8: `tags`, each a SHORT of value `orientation`."""
    e = "<" if order == b"II" else ">"
    entries = b"".join(struct.pack(e + "HHIHH", tag, 3, 1, orientation, 0) for tag in tags)
    return order + struct.pack(e + "HI", magic, 8) + struct.pack(e + "H", len(tags)) + entries + b"\0\0\0\0"


def exif(orientation: int, **options: object) -> bytes:
    return segment(0xE1, b"Exif\0\0" + tiff(orientation, **options))


XMP = segment(0xE1, b"http://ns.adobe.com/xap/1.0/\0<x:xmpmeta xmlns:x='adobe:ns:meta/'/>")


def after_soi(data: bytes, *segments: bytes) -> bytes:
    return data[:2] + b"".join(segments) + data[2:]


def claiming(data: bytes, width: int, height: int) -> bytes:
    """`data` with its frame header claiming `width` x `height`: the file stays a few hundred bytes."""
    out = bytearray(data)
    sof = next(i for i in range(2, len(out) - 1) if out[i] == 0xFF and out[i + 1] in (0xC0, 0xC1, 0xC2, 0xC9))
    out[sof + 5 : sof + 9] = struct.pack(">HH", height, width)
    return bytes(out)


def cjpeg(image: Image.Image, *arguments: str) -> bytes | None:
    """libjpeg-turbo's cjpeg on `image` (None where it is not installed)."""
    if shutil.which("cjpeg") is None:
        return None
    with tempfile.TemporaryDirectory() as folder:
        source, scans = Path(folder, "in.ppm"), Path(folder, "scans.txt")
        image.save(source)
        scans.write_text("0;\n1;\n2;\n")  # each component in a scan of its own: a sequential, non-interleaved file
        arguments = tuple(str(scans) if a == "SCANS" else a for a in arguments)
        return subprocess.run(["cjpeg", *arguments, str(source)], capture_output=True, check=True).stdout


def seeds() -> dict[str, bytes | None]:
    base, small = picture(), picture(16, 16)
    baseline = encoded(base)
    progressive_small, baseline_small = encoded(small, progressive=True), encoded(small)
    nonint_small = cjpeg(small, "-scans", "SCANS")
    rst = baseline[:2] + b"\xff\xd0" * 4200 + baseline[2:]  # more markers before the frame than are read
    return {
        # made by encoders
        "baseline_420.jpg": baseline,
        "baseline_444.jpg": encoded(base, subsampling=0),
        "progressive_420.jpg": encoded(base, progressive=True),
        "gray.jpg": encoded(base.convert("L")),
        "cmyk.jpg": encoded(base.convert("CMYK")),
        "restart_markers.jpg": encoded(base, restart_marker_blocks=2),
        "exif6_pillow.jpg": encoded(base, exif=_pillow_exif(6)),
        "exif8_xmp_icc.jpg": encoded(base, exif=_pillow_exif(8), xmp=b"<x:xmpmeta/>", icc_profile=bytes(70_000)),
        "nonint_baseline.jpg": cjpeg(base, "-scans", "SCANS"),
        "arithmetic.jpg": cjpeg(base, "-arithmetic"),
        # orientation: how TorchCodec reads the first APP1 (regression seeds: XMP before EXIF turned two ways)
        "exif6_mm.jpg": after_soi(baseline, exif(6)),
        "exif5_ii.jpg": after_soi(baseline, exif(5, order=b"II")),
        "xmp_before_exif6.jpg": after_soi(baseline, XMP, exif(6)),
        "exif6_magic43.jpg": after_soi(baseline, exif(6, magic=43)),
        "exif6_byte_order_xx.jpg": after_soi(baseline, exif(6, order=b"XX")),
        "exif1_before_exif6.jpg": after_soi(baseline, exif(1), exif(6)),
        "exif_tag_ffff_before_orientation.jpg": after_soi(baseline, exif(6, tags=(0xFFFF, ORIENTATION))),
        "short_app1_before_exif6.jpg": after_soi(baseline, segment(0xE1, b"Exif"), exif(6)),
        "exif_directory_offset_wraps.jpg": after_soi(
            baseline, segment(0xE1, b"Exif\0\0MM\0\x2a\xff\xff\xff\xfe" + tiff(7)[8:])
        ),
        # markers as libjpeg reads them
        "junk_before_markers.jpg": baseline[:2] + b"\xff\xfe\x00\x04ab" + b"junk\x00\xff\x00" + baseline[2:],
        "fill_bytes.jpg": baseline[:2] + b"\xff" * 64 + baseline[2:],
        "many_rst_markers.jpg": rst,
        "truncated_header.jpg": baseline[:100],
        # sizes a header claims (regression seeds: a 2-KB progressive file held 2.7 GB at 1/8)
        "progressive_claims_30000x30000.jpg": claiming(progressive_small, 30000, 30000),
        "progressive_claims_65500x65500.jpg": claiming(progressive_small, 65500, 65500),
        "nonint_claims_30000x30000.jpg": claiming(nonint_small, 30000, 30000) if nonint_small else None,
        "baseline_claims_30000x30000.jpg": claiming(baseline_small, 30000, 30000),
        "baseline_claims_65500x65500.jpg": claiming(baseline_small, 65500, 65500),
    }


def _pillow_exif(orientation: int) -> Image.Exif:
    found = Image.Exif()
    found[ORIENTATION] = orientation
    return found


if __name__ == "__main__":
    for name, data in seeds().items():
        if data is None:
            print(f"skipped {name}: cjpeg (libjpeg-turbo-progs) is not installed")
            continue
        (HERE / name).write_bytes(data)
        print(f"{name}: {len(data):,} bytes")
