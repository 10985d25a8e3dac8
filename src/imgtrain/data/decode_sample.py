"""What decoding a run's own photos costs, and what packing them smaller or decoding them at a reduced scale saves:
timed on a few dozen of the training split's JPEGs, once, when the run's verdict finds that decoding bounds it
(metrics/processor.py), so that the verdict prescribes from the files themselves (metrics/report.py).

Up to FILES JPEGs are drawn from the split by a seeded draw (the run's seed; files that are not JPEGs are skipped).
Each is read once, and its bytes decoded three ways, once each, the order rotated from one file to the next so
that a drift (a CPU clocking down, another process waking) reaches every method alike:
- full: `decoders.decode_bytes`, every pixel;
- scaled: `scaled_decode.decode_for_crop` for the split's crop, its box drawn from the seed the file's sample had in
  the run's first epoch (`samplers.sample_seed(seed, 0, index)`). A training box's scale varies from sample to
  sample (RandomResizedCrop), so one draw per file, over files, stands for the run's mix of scales;
- packed: the bytes `imgtrain-shards --max-side N` would store (`downscale.MaxSide(N).shrunk`, not timed; a file
  already at most N px is its own bytes), decoded as this run decodes (at a reduced scale where it is on).
On a thread of its own (torch.set_num_threads(1) there), with time.perf_counter. Each speed-up is the median of
the per-file ratios, with their quartiles for the spread. Sampling stops after BUDGET_S seconds (reads and the
untimed shrinking included), so a run waits a few seconds at most; local files only (dataset=shards, object
storage included, is never sampled). Files are read as the loaders read them (data/reads.py: regular files only,
at most the byte cap), and a read or decode that has not returned STUCK_S seconds past LIMIT_S (hung storage) is
left behind on its daemon thread: the run goes on without a sample, and the warning names the file.
"""

from __future__ import annotations

import logging
import statistics
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from imgtrain.data import reads
from imgtrain.data.batched import CropSpec
from imgtrain.data.decoders import DECODE_ERRORS, decode_bytes, read_file
from imgtrain.data.image_files import EncodedFileDataset, ImageFileDataset
from imgtrain.data.jpeg import jpeg_header
from imgtrain.data.samplers import sample_seed
from imgtrain.data.scaled_decode import decode_for_crop
from imgtrain.data.shards.downscale import MaxSide

FILES = 24  # JPEGs timed at most: enough for a median and quartiles of the per-file ratios
MIN_FILES = 5  # fewer found (or timed within the limits): no sample
EXAMINED = 4 * FILES  # files read at most while looking for JPEGs (a folder of PNGs stops here)
BUDGET_S = 3.0  # no file is started after this many seconds once MIN_FILES are timed
LIMIT_S = 10.0  # nor after this many before that (100-MP photos take about 1 s a file, shrinking included)
MAX_SIDE = 512  # the --max-side prescribed: imgtrain-shards' documented example for 224-px crops
STUCK_S = 20.0  # seconds past LIMIT_S after which a sample still in one file is left behind
log = logging.getLogger(__name__)


def packing_side(crop: int | None) -> int:
    """The --max-side to prescribe for crops of `crop` px (None: not known): MAX_SIDE, or twice the crop when that
    is larger, so that a RandomResizedCrop box still finds at least its output's pixels."""
    return max(MAX_SIDE, 2 * crop) if crop else MAX_SIDE


def sample_decodes(dataset: Any, seed: int = 0, budget_s: float = BUDGET_S) -> dict[str, Any] | None:
    """The decode timings of up to FILES of `dataset`'s JPEGs (module docstring), JSON-friendly; None for anything
    but a Dataset of image files decoded on the CPU (`ImageFileDataset`), or when fewer than MIN_FILES JPEGs were
    timed. `seed` draws the files and their crops (the run's train.seed)."""
    if not isinstance(dataset, ImageFileDataset) or isinstance(dataset, EncodedFileDataset) or not len(dataset):
        return None
    draw = np.random.default_rng(seed).choice(len(dataset), size=min(len(dataset), EXAMINED), replace=False)
    outcome: list[Any] = []  # the summary (or None), or the exception that ended the sample
    current: list[str] = []  # the file in hand

    def sample() -> None:
        try:
            outcome.append(_sampled(dataset, draw.tolist(), seed, budget_s, current))
        except Exception as error:  # noqa: BLE001 - raised in the caller's thread, as if sampled there
            outcome.append(error)

    thread = threading.Thread(target=sample, name="decode-sample", daemon=True)
    thread.start()
    thread.join(LIMIT_S + STUCK_S)
    if not outcome:
        stuck = reads.in_read(thread.ident) or (current[-1] if current else "a file")
        log.warning(
            "the decode sample gave up waiting: %s has not been read and decoded in %.0f s (hung storage?); the "
            "verdict gives the general advice",
            stuck,
            STUCK_S,
        )
        return None
    if isinstance(outcome[0], Exception):
        raise outcome[0]
    return outcome[0]


def _sampled(
    dataset: ImageFileDataset, indices: list[int], seed: int, budget_s: float, current: list[str]
) -> dict[str, Any] | None:
    """The sample's summary (`sample_decodes`), timed on this thread alone; `current` gets each file's path."""
    spec = dataset.crop_spec  # None: a per-sample transform, which never decodes at a reduced scale
    scaled = dataset.scaled and spec is not None
    side = packing_side(spec.size if spec else None)
    started, rows = time.perf_counter(), []
    torch.set_num_threads(1)  # what one loader worker has: the figures are per core (OpenMP's setting is per thread)
    for index in indices:
        elapsed = time.perf_counter() - started
        if len(rows) >= FILES or elapsed > LIMIT_S or (elapsed > budget_s and len(rows) >= MIN_FILES):
            break
        current.append(dataset.path(index))
        row = _time_file(dataset, index, (sample_seed(seed, 0, index), spec), side, scaled, len(rows))
        rows += [row] if row else []
    if len(rows) < MIN_FILES:
        return None
    return _summary(rows, spec, dataset.scaled, side, time.perf_counter() - started)


def _time_file(
    dataset: ImageFileDataset, index: int, crop: tuple[int, CropSpec | None], side: int, scaled: bool, turn: int
) -> dict[str, float] | None:
    """One file's decode times in ms (full, scaled where a crop spec exists, packed) and its upright size; None for
    a file that is not a JPEG, or that cannot be read or decoded."""
    path, (sample, spec) = dataset.path(index), crop
    try:
        data = read_file(path, dataset.max_pixels)  # a regular file, its size and the cap at most (data/reads.py)
        frame = jpeg_header(memoryview(data.numpy()))
        if frame is None:
            return None
        shrunk = MaxSide(side).shrunk(data.numpy().tobytes(), dataset.max_pixels)
    except DECODE_ERRORS:
        return None
    packed = data if shrunk is None else torch.frombuffer(bytearray(shrunk), dtype=torch.uint8)

    def as_run(encoded: torch.Tensor) -> Callable[[], Any]:  # what this run's decode does with these bytes
        if scaled:
            return lambda: decode_for_crop(encoded, path, dataset.max_pixels, sample, spec)
        return lambda: decode_bytes(encoded, path, dataset.max_pixels)

    methods: dict[str, Callable[[], Any]] = {"full": lambda: decode_bytes(data, path, dataset.max_pixels)}
    if spec is not None:
        methods["scaled"] = lambda: decode_for_crop(data, path, dataset.max_pixels, sample, spec)
    methods["packed"] = as_run(packed)
    names = list(methods)
    names = names[turn % len(names) :] + names[: turn % len(names)]  # rotated: each method leads a file in turn
    row = {"megapixels": frame.width * frame.height / 1e6, "longer_side": float(max(frame.width, frame.height))}
    try:
        for name in names:
            begun = time.perf_counter()
            methods[name]()
            row[name] = (time.perf_counter() - begun) * 1e3
    except DECODE_ERRORS:
        return None
    return row


def _summary(
    rows: list[dict[str, float]], spec: CropSpec | None, configured: bool, side: int, seconds: float
) -> dict[str, Any]:
    """The sample as metrics.json keeps it: medians over files, and each speed-up's median and quartiles of the
    per-file ratios. `packed` is against what this run decodes (`as_run`), `scaled` against the full decode."""
    as_run = "scaled" if configured and spec is not None else "full"

    def ms(name: str) -> float | None:
        return round(statistics.median(row[name] for row in rows), 2) if name in rows[0] else None

    def speedup(slow: str, fast: str) -> dict[str, Any] | None:
        if fast not in rows[0]:
            return None
        ratios = [row[slow] / max(row[fast], 1e-6) for row in rows]
        low, _, high = statistics.quantiles(ratios, n=4, method="inclusive")
        return {"median": round(statistics.median(ratios), 2), "quartiles": [round(low, 2), round(high, 2)]}

    return {
        "files": len(rows),
        "megapixels": round(statistics.median(row["megapixels"] for row in rows), 2),
        "longer_side": round(statistics.median(row["longer_side"] for row in rows)),
        "crop": spec.size if spec else None,
        "scaled_decode": configured,  # dataset.scaled_decode
        "as_run": as_run,  # what this run's decode is: "scaled" where it is on and the transform is a crop spec
        "max_side": side,
        "ms": {name: ms(name) for name in ("full", "scaled", "packed")},
        "packed_speedup": speedup(as_run, "packed"),
        "scaled_speedup": speedup("full", "scaled"),
        "seconds": round(seconds, 2),
    }
