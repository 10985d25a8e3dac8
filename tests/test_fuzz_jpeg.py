"""Fuzz targets for the JPEG header and EXIF reader (data/jpeg.py) and for decoding under dataset.max_image_pixels
(data/decoders.py, data/scaled_decode.py): Hypothesis, from the seeds in fuzz_seeds/jpeg/ (files of real encoders
and crafted ones, each crash or hang found a seed; make_seeds.py writes them). The properties:
- the header reader never raises, and no input costs it a second (Hypothesis' deadline);
- it reads what libjpeg reads: the size libjpeg-turbo reads from the same header (simplejpeg's header call), and the
  orientation TorchCodec turns the image by (its pixels against each of the 8 turns of the stored image); on a
  valid EXIF block PIL's exif_transpose agrees as well;
- decoding raises only DECODE_ERRORS (an unreadable file, counted), within the deadline;
- no decode holds more memory than dataset.max_image_pixels allows: the peak resident memory of each decode,
  measured in a subprocess under an address-space cap.
The fast suite runs each target on FAST examples; the slow test runs them on SLOW.
"""

from __future__ import annotations

import contextlib
import functools
import io
import json
import re
import struct
import subprocess
import sys
import time
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image, ImageOps

# The GPU box has neither until its wheels are installed: skipped there, not errors
pytest.importorskip("hypothesis", reason="the fuzz targets need Hypothesis: pip install -e '.[dev]'")
pytest.importorskip("simplejpeg", reason="the scaled-decoding targets need simplejpeg: pip install -e .")

import simplejpeg  # noqa: E402
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from imgtrain.config.datasets import MAX_IMAGE_PIXELS  # noqa: E402
from imgtrain.data import scaled_decode  # noqa: E402
from imgtrain.data.batched import CropSpec  # noqa: E402
from imgtrain.data.decoders import DECODE_ERRORS, decode_bytes, upright  # noqa: E402
from imgtrain.data.jpeg import MAX_MARKERS, JpegFrame, exif_orientation, jpeg_frame  # noqa: E402
from imgtrain.data.scaled_decode import Reduced, decode_for_crop  # noqa: E402

SEED_DIR = Path(__file__).resolve().parent / "fuzz_seeds" / "jpeg"
SEEDS = {path.name: path.read_bytes() for path in sorted(SEED_DIR.glob("*.jpg"))}
BASE = SEEDS["baseline_420.jpg"]  # 48 x 32, no APP1: what the EXIF targets put their segments into
FAST, SLOW = 100, 1000  # examples per target: the fast suite's few seconds, make test-slow's minute
DEADLINE_MS = 1000  # the bound on one input
LIMIT = 4_000_000  # dataset.max_image_pixels in these tests: above every seed decoded in full, below their claims
SPEC = CropSpec(224, scale=(0.08, 1.0), flip_p=0.5)
TOO_MANY_MARKERS = f"damaged JPEG header (more than {MAX_MARKERS} markers before the image data)"


def _decoded(data: bytes) -> torch.Tensor | None:
    """TorchCodec's image (turned as it turns it), or None where it does not decode the file."""
    from torchcodec.decoders import decode_jpeg  # its libjpeg path, whatever the first bytes say

    try:
        return decode_jpeg(torch.frombuffer(bytearray(data), dtype=torch.uint8), mode="RGB")
    except (RuntimeError, ValueError):
        return None


@functools.cache
def stored_base() -> torch.Tensor:
    """BASE as TorchCodec decodes it (no APP1: as stored), decoded on first use: not while tests are collected,
    where loading TorchCodec's libjpeg would change what other modules see mapped."""
    return _decoded(BASE)


def _turn_of(image: torch.Tensor, stored: torch.Tensor) -> int | None:
    """The EXIF orientation by which `stored` became `image` (this asymmetric picture differs under each turn)."""
    turns = [upright(stored, o) for o in range(1, 9)]
    found = [o for o, turn in enumerate(turns, 1) if turn.shape == image.shape and torch.equal(turn, image)]
    return found[0] if len(found) == 1 else None


def _segment(marker: int, payload: bytes) -> bytes:
    return bytes([0xFF, marker]) + struct.pack(">H", len(payload) + 2) + payload


def _libjpeg_size(data: bytes) -> tuple[int, int] | None:
    """(height, width) as libjpeg-turbo's jpeg_read_header reads them (simplejpeg's header call, its warnings
    allowed, as TorchCodec allows them); None where it does not read the header."""
    try:
        height, width, _, _ = simplejpeg.decode_jpeg_header(data, strict=False)
    except (ValueError, RuntimeError, KeyError):  # KeyError: a colour space simplejpeg does not name
        return None
    return height, width


# ------------------------------------------------------------------ the EXIF reader, against TorchCodec and PIL
@st.composite
def tiff_blocks(draw: st.DrawFn) -> tuple[bytes, bool]:
    """An APP1 payload: an EXIF block built field by field (byte order, magic, directory offset, entries, each
    field often valid and sometimes anything), and whether it is a valid one (PIL reads it as TorchCodec does)."""
    header = draw(st.sampled_from([b"Exif\0\0", b"Exif\0\0", b"http:/", b"Exig\0\0"]))
    order = draw(st.sampled_from([b"MM", b"II", b"MI", b"XX"]))
    big = order != b"II"
    e = ">" if big else "<"
    magic = draw(st.sampled_from([42, 42, 43]) | st.integers(0, 0xFFFF))
    offset = draw(st.sampled_from([8, 8, 10, 0xFFFFFFFE, 0xFFFFFFFF]) | st.integers(0, 80))
    entries = draw(
        st.lists(
            st.tuples(
                st.sampled_from([0x0112, 0x0112, 0xFFFF, 0x010F]) | st.integers(0, 0xFFFF),  # the tag
                st.sampled_from([3, 3, 4]) | st.integers(0, 0xFFFF),  # SHORT, LONG, anything
                st.integers(1, 8) | st.integers(0, 0xFFFF),  # the value in the field's first 16 bits
            ),
            max_size=5,
        )
    )
    count = draw(st.just(len(entries)) | st.integers(0, 0xFFFF))
    body = order + struct.pack(e + "HI", magic, offset & 0xFFFFFFFF) + struct.pack(e + "H", count)
    body += b"".join(struct.pack(e + "HHIHH", tag, kind, 1, value, 0) for tag, kind, value in entries)
    tail = draw(st.binary(max_size=12))
    tags = [tag for tag, _, _ in entries]
    turns = [(kind, value) for tag, kind, value in entries if tag == 0x0112]
    readable = header == b"Exif\0\0" and order in (b"MM", b"II") and (magic, offset, count) == (42, 8, len(entries))
    one_turn = len(turns) <= 1 and all(kind == 3 and 1 <= value <= 8 for kind, value in turns)
    before = tags[: tags.index(0x0112)] if turns else tags
    valid = readable and one_turn and 0xFFFF not in before
    return header + body + tail, valid


def _exif_target(payload: bytes, later: list[bytes], valid: bool) -> None:
    data = BASE[:2] + _segment(0xE1, payload) + b"".join(_segment(0xE1, p) for p in later) + BASE[2:]
    frame = jpeg_frame(data)
    assert isinstance(frame, JpegFrame)
    decoded = _decoded(data)
    assert decoded is not None
    assert frame.orientation == _turn_of(decoded, stored_base()), payload  # the turn TorchCodec applies
    assert frame.upright_size == tuple(decoded.shape[1:])
    if valid and not later:  # PIL reads a valid block as TorchCodec does
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # PIL on a corrupt EXIF tail
            shown = ImageOps.exif_transpose(Image.open(io.BytesIO(data)))
        assert shown.size[::-1] == frame.upright_size
        stored = torch.from_numpy(np.asarray(Image.open(io.BytesIO(data)).convert("RGB")).copy()).permute(2, 0, 1)
        pil = torch.from_numpy(np.asarray(shown.convert("RGB")).copy()).permute(2, 0, 1)
        assert torch.equal(upright(stored, frame.orientation), pil)


EXIF_6 = b"Exif\0\0MM\0\x2a\0\0\0\x08\0\x01\x01\x12\0\x03\0\0\0\x01\0\x06\0\0"  # orientation 6, big-endian
_EXIF = (tiff_blocks(), st.lists(st.just(EXIF_6), max_size=1))


@settings(max_examples=FAST, deadline=DEADLINE_MS)
@given(*_EXIF)
def test_the_orientation_read_is_the_one_torchcodec_turns_by(block: tuple[bytes, bool], later: list[bytes]) -> None:
    """Whatever the first APP1 holds (and an EXIF orientation of 6 after it): the header reader gives the turn
    TorchCodec applies, which the scaled path, decode=cuda and --max-side then apply too; PIL agrees on valid blocks."""
    _exif_target(block[0], later, block[1])


def test_exif_reader_on_raw_bytes_never_raises() -> None:
    """Any payload (truncated blocks, offsets past the end or wrapping at 32 bits): a value 1-8 or None, fast."""
    rng = np.random.default_rng(0)
    for size in (0, 1, 6, 7, 8, 9, 14, 20, 100, 65533):
        for _ in range(20):
            payload = b"Exif\0\0MM\0\x2a" + rng.integers(0, 256, size, dtype=np.uint8).tobytes()
            assert exif_orientation(payload) in (None, *range(1, 9))
    worst = b"Exif\0\0MM\0\x2a\xff\xff\xff\xfe" + b"\x01\x00" * 32_760  # 65,535 entries counted, none found
    started = time.perf_counter()
    assert exif_orientation(worst) is None
    assert time.perf_counter() - started < 0.5


# ------------------------------------------------------------------ the header reader, against libjpeg
@st.composite
def mutated_seeds(draw: st.DrawFn) -> bytes:
    """A seed (real encoders' small files) with 1-4 edits in its first 800 bytes, where the markers are: bytes
    overwritten, junk or fill bytes or markers inserted, bytes deleted, segments repeated, the file cut short."""
    name = draw(st.sampled_from([n for n, d in SEEDS.items() if len(d) < 2_000 and "claims" not in n]))
    data = bytearray(SEEDS[name])
    for _ in range(draw(st.integers(1, 4))):
        pos = draw(st.integers(2, min(len(data), 800)))
        edit = draw(st.sampled_from(["overwrite", "insert", "delete", "repeat", "cut"]))
        if edit == "overwrite":
            data[pos : pos + 2] = draw(st.binary(min_size=1, max_size=2))
        elif edit == "insert":
            data[pos:pos] = draw(
                st.sampled_from([b"\xff", b"\xff\xff\xff", b"\x00", b"\xff\x00", b"\xff\xd0", b"\xff\xe1\x00\x00"])
                | st.binary(max_size=8)
            )
        elif edit == "delete":
            del data[pos : pos + draw(st.integers(1, 8))]
        elif edit == "repeat":
            data[pos:pos] = data[max(2, pos - 20) : pos]
        else:
            del data[pos:]
    return bytes(data)


def _header_target(data: bytes) -> None:
    frame = jpeg_frame(data)  # never raises: a JpegFrame or why not
    assert isinstance(frame, JpegFrame | str)
    size = _libjpeg_size(data)  # libjpeg's header read, lenient as a whole decode is not (a cut file passes)
    if size is None:
        return
    if isinstance(frame, JpegFrame):  # the size the pixel limit is checked against is libjpeg's
        assert (frame.height, frame.width) == size, (frame, size)
    decoded = _decoded(data) if size[0] * size[1] <= 4096 else None  # small claims only: safe to decode
    if decoded is None:
        return
    if frame == TOO_MANY_MARKERS:  # refused on purpose: reading them costs time (test_hostile_headers...)
        return
    assert isinstance(frame, JpegFrame), frame  # what TorchCodec decodes, the template reads
    assert frame.upright_size == tuple(decoded.shape[1:])
    head = data[: frame.data_start]  # its APP1 segments made APP2 (skipped alike, never read for EXIF): as stored
    stored = _decoded(head.replace(b"\xff\xe1", b"\xff\xe2") + data[frame.data_start :])
    turn = None if stored is None else _turn_of(decoded, stored)
    assert turn in (None, frame.orientation), (turn, frame)  # None: a picture that looks the same turned


@settings(max_examples=FAST, deadline=DEADLINE_MS, suppress_health_check=[HealthCheck.too_slow])
@given(mutated_seeds())
def test_the_header_reader_reads_what_libjpeg_reads(data: bytes) -> None:
    _header_target(data)


def test_every_seed_reads_as_libjpeg_and_torchcodec_read_it() -> None:
    """The seeds themselves: the size libjpeg reads, and the turn TorchCodec applies (the crafted EXIF seeds, the
    XMP segment before an EXIF orientation among them, turn one way on every path: scaled decoding included)."""
    turned = set()
    for name, data in SEEDS.items():
        _header_target(data)
        frame = jpeg_frame(data)
        if not isinstance(frame, JpegFrame) or frame.width * frame.height > LIMIT:
            continue
        full = decode_bytes(torch.frombuffer(bytearray(data), dtype=torch.uint8), name)
        assert tuple(full.shape[1:]) == frame.upright_size, name
        if _turn_of(full, stored_base()) is not None:  # the base picture's pixels (segments added to its file)
            assert _turn_of(full, stored_base()) == frame.orientation, name
            turned.add(name)
        reduced = decode_for_crop(torch.frombuffer(bytearray(data), dtype=torch.uint8), name, LIMIT, 0, CropSpec(8))
        if isinstance(reduced, Reduced):  # at 1/4: the same picture, the same way up
            assert reduced.full == frame.upright_size, name
            small = torch.nn.functional.avg_pool2d(full[None].float(), 4)[0]
            assert (reduced.image.float() - small).abs().mean() < 12, name
    assert {n for n in SEEDS if n.startswith(("exif", "xmp", "short"))} <= turned


def test_hostile_headers_cost_milliseconds() -> None:
    """Megabytes of fill bytes, junk, stuffed zeros or two-byte markers before the frame: one pass in C, and at most
    MAX_MARKERS markers read in Python (past that, the file is refused in one line)."""
    head = b"\xff\xd8"
    cases = {
        "fill": head + b"\xff" * 8_000_000 + BASE[2:],
        "junk": head + b"\x00" * 8_000_000 + BASE[2:],
        "stuffed": head + b"\xff\x00" * 4_000_000 + BASE[2:],
        "restarts": head + b"\xff\xd0" * 4_000_000 + BASE[2:],
    }
    for name, data in cases.items():
        started = time.perf_counter()
        frame = jpeg_frame(data)
        assert time.perf_counter() - started < 0.5, name
        if name == "restarts":
            assert frame == TOO_MANY_MARKERS
        else:
            assert isinstance(frame, JpegFrame) and (frame.width, frame.height) == (48, 32), name


# ------------------------------------------------------------------ decoding: its errors and its time
def _decode_target(data: bytes) -> None:
    tensor = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    for decode in (
        lambda: decode_bytes(tensor, "fuzzed.jpg", LIMIT),
        lambda: decode_for_crop(tensor, "fuzzed.jpg", LIMIT, 0, SPEC),
        lambda: decode_for_crop(tensor, "fuzzed.jpg", LIMIT, None, CropSpec(8, resize=8)),
    ):
        with contextlib.suppress(*DECODE_ERRORS):  # an unreadable file, counted: anything else escaping is a bug
            decode()


@settings(max_examples=FAST, deadline=DEADLINE_MS, suppress_health_check=[HealthCheck.too_slow])
@given(mutated_seeds())
def test_decoding_a_damaged_file_raises_only_what_is_counted_as_unreadable(data: bytes) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # libjpeg's and PIL's warnings on damaged files
        _decode_target(data)


@pytest.mark.slow  # minutes: each target on SLOW examples
def test_the_fuzz_targets_on_a_larger_budget() -> None:
    for target, strategies in (
        (lambda block, later: _exif_target(block[0], later, block[1]), _EXIF),
        (_header_target, (mutated_seeds(),)),
        (_decode_target, (mutated_seeds(),)),
    ):
        run = settings(max_examples=SLOW, deadline=DEADLINE_MS, suppress_health_check=list(HealthCheck))(
            given(*strategies)(target)
        )
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            run()


# ------------------------------------------------------------------ what a decode holds, against the limit
# Per decode, at most this many bytes per pixel the limit allows (and some slack): 2 bytes a sample of DCT
# coefficients for up to 4 components (libjpeg's whole-image buffers), the RGB output, and its upright copy
BYTES_PER_LIMIT_PIXEL, SLACK = 16, 64 << 20


def _status(key: str) -> int:
    """A field of /proc/self/status, in bytes (VmRSS: resident now; VmHWM: its peak since the last reset)."""
    return int(re.search(key + r":\s+(\d+) kB", Path("/proc/self/status").read_text())[1]) * 1024


def held_per_decode(files: dict[str, bytes], limit: int) -> list[dict]:
    """Each file decoded in full, at reduced scale by simplejpeg and by PIL's draft (simplejpeg made absent), with
    `limit` as dataset.max_image_pixels: the peak resident memory each decode added (the kernel's high-water mark,
    reset before it: /proc/self/clear_refs) and how it ended."""
    rows, fast = [], scaled_decode.simplejpeg
    for name, data in files.items():
        for mode in ("full", "scaled", "scaled-pil"):
            tensor = torch.frombuffer(bytearray(data), dtype=torch.uint8)
            scaled_decode.simplejpeg = None if mode == "scaled-pil" else fast
            Path("/proc/self/clear_refs").write_text("5")  # the peak resident set starts again from here
            before = _status("VmRSS")
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    if mode == "full":
                        decode_bytes(tensor, name, limit)
                    else:
                        decode_for_crop(tensor, name, limit, 0, SPEC)
                outcome = "decoded"
            except DECODE_ERRORS as error:
                outcome = f"{type(error).__name__}: {str(error)[:100]}"
            except MemoryError:
                outcome = "MemoryError"
            finally:
                scaled_decode.simplejpeg = fast
            rows.append({"name": name, "mode": mode, "held": _status("VmHWM") - before, "outcome": outcome})
    return rows


def _claims(rng: np.random.Generator, count: int) -> dict[str, bytes]:
    """Small files whose headers claim sizes around the limit's edges (from half the limit to 80 times it, in full
    and so at 1/8 scale), up to 65535 a side: baseline, progressive, and sequential with one component a scan."""
    kinds = {"baseline": "baseline_420.jpg", "progressive": "progressive_420.jpg", "nonint": "nonint_baseline.jpg"}
    claims = {}
    for i in range(count):
        kind = list(kinds)[i % 3]
        pixels = LIMIT * float(np.exp(rng.uniform(np.log(0.5), np.log(80))))
        ratio = float(np.exp(rng.uniform(-2, 2)))
        width = int(min(65535, max(1, round(np.sqrt(pixels * ratio)))))
        height = int(min(65535, max(1, round(pixels / width))))
        data = bytearray(SEEDS[kinds[kind]])
        sof = next(p for p in range(2, len(data)) if data[p] == 0xFF and data[p + 1] in (0xC0, 0xC2))
        data[sof + 5 : sof + 9] = struct.pack(">HH", height, width)
        claims[f"{kind}_{width}x{height}.jpg"] = bytes(data)
    return claims


def _over(rows: list[dict], limit: int) -> list[dict]:
    """The decodes that held more than `limit` allows, or ran out of memory."""
    allowed = BYTES_PER_LIMIT_PIXEL * limit + SLACK
    return [row for row in rows if row["held"] > allowed or "emory" in row["outcome"]]


def test_no_decode_holds_more_than_the_pixel_limit_allows() -> None:
    """Every seed and 24 claimed sizes, decoded in full, at a reduced scale by simplejpeg and by PIL's draft: the
    peak resident memory of each decode is within 16 bytes a pixel of dataset.max_image_pixels (and 64 MiB). A
    progressive header claiming 16000 x 16000 passed a 4-MP limit at 1/8, and held 781 MB of coefficients (measured)."""
    claims = _claims(np.random.default_rng(0), 24)
    rows = held_per_decode({**SEEDS, **claims}, LIMIT)
    assert len(rows) == 3 * (len(SEEDS) + len(claims))
    assert not _over(rows, LIMIT)
    assert any(row["outcome"] == "decoded" and row["mode"] == "scaled-pil" for row in rows)  # each path ran


_CAPPED = """
import json, resource, sys
sys.path.insert(0, sys.argv[1])
import test_fuzz_jpeg as fuzz
resource.setrlimit(resource.RLIMIT_AS, (fuzz._status("VmSize") + (3 << 30), resource.RLIM_INFINITY))
files = {name: open(path, "rb").read() for name, path in json.loads(sys.argv[3]).items()}
print(json.dumps(fuzz.held_per_decode(files, int(sys.argv[2]))))
"""


@pytest.mark.slow  # a few minutes: 600 claimed sizes, and the seeds under the default limit
@pytest.mark.parametrize("limit", [LIMIT, MAX_IMAGE_PIXELS])
def test_no_decode_holds_more_than_the_limit_allows_under_a_memory_cap(tmp_path: Path, limit: int) -> None:
    """The same measure in a process of its own whose address space is capped 3 GiB above its start (a decode
    that would hold 13 GB, as a 65500 x 65500 progressive header at 1/8 did, fails there, not the machine)."""
    files = {**SEEDS, **(_claims(np.random.default_rng(1), 600) if limit == LIMIT else {})}
    for name, data in files.items():
        (tmp_path / name).write_bytes(data)
    paths = json.dumps({name: str(tmp_path / name) for name in files})
    here = str(Path(__file__).resolve().parent)
    result = subprocess.run(
        [sys.executable, "-c", _CAPPED, here, str(limit), paths], capture_output=True, text=True, timeout=900
    )
    assert result.returncode == 0, result.stderr[-2000:]
    rows = json.loads(result.stdout.strip().splitlines()[-1])
    assert len(rows) == 3 * len(files) and not _over(rows, limit)
