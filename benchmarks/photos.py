"""A JPEG ImageFolder of photo-like images in ImageNet's mix of sizes, with a few 12-MP photos: the folder the
ResNet-50 JPEG rows read (bench.py's gpu-jpeg section, gpu_check.py's r50_jpeg rows).

Why mixed sizes: with images of one size every batch takes dataset.decode=cuda's single-stack fast path; real
folders go through per-image windows (data/resample.py) issued from the decode thread, and a 12-MP photo costs
a CPU worker ~100 times a 500x375 one. The sizes drawn (`draw_size`), from ImageNet's training set (ILSVRC-2012:
most images are Flickr downloads 500 px on the long side, 500x375 or 375x500; the rest spread from about 100 px
up, aspect ratios about 1:1 to 2:1; mean about 400x350): BIG_SHARE of the files are 4000x3000 (12 MP, a
phone's photo), the others 500 px on the long side with probability 0.7, else log-uniform on 100-800 px; the
aspect ratio 4:3 (60%), 3:2 (15%), 1:1 (10%) or uniform on 1-2 (15%); a quarter portrait. That gives a mean
of about 420x370 px outside the 12-MP photos. The content compresses like a photo at quality 90: a smooth random
colour field, textures at two scales and a little pixel noise (neither flat shapes nor pure noise).

Generation is deterministic given the seed, runs on every core and is published with an atomic rename; a file
`sizes.json` lists each training file's size, read back by `describe`. Imports no torch.
"""

from __future__ import annotations

import io
import json
import math
import multiprocessing
import os
import shutil
import sys
import uuid
from pathlib import Path

import numpy as np
from PIL import Image

FORMAT_VERSION = 1  # bump when the drawing or the distribution changes: caches are regenerated
BIG = (4000, 3000)  # 12 MP
BIG_SHARE = 0.03  # "a few percent" of 12-MP photos: 3% of the files, about 70% of the pixels
LONG_SIDE = 500  # Flickr's download size that most ImageNet images have
CLASSES = 10
QUALITY = 90
# (train, val) files: 50 steps of 256 an epoch (an epoch start every 50 steps, as in a folder this size); the
# 12-MP photos take about 1.7 GB of it
FULL_COUNTS = (12_800, 256)
QUICK_COUNTS = (64, 16)
QUICK_SCALE = 0.25  # the smoke test's sides: the same distribution, a quarter of the side (BIG: 1000x750)


def spec(quick: bool) -> tuple[tuple[int, int], float]:
    """(train and val files, side scale) of the folder the JPEG rows read: the GPU's or the smoke test's."""
    return (QUICK_COUNTS, QUICK_SCALE) if quick else (FULL_COUNTS, 1.0)


def draw_size(rng: np.random.Generator, scale: float = 1.0) -> tuple[int, int]:
    """(width, height) from the distribution in the module's docstring, sides times `scale`."""
    if rng.random() < BIG_SHARE:
        long, short = BIG
    else:
        long = LONG_SIDE if rng.random() < 0.7 else math.exp(rng.uniform(math.log(100), math.log(800)))
        pick = rng.random()
        aspect = 4 / 3 if pick < 0.6 else 1.5 if pick < 0.75 else 1.0 if pick < 0.85 else rng.uniform(1, 2)
        short = long / aspect
    width, height = (short, long) if rng.random() < 0.25 else (long, short)  # a quarter portrait
    return max(16, round(width * scale)), max(16, round(height * scale))


def render(width: int, height: int, rng: np.random.Generator) -> bytes:
    """One photo-like JPEG: a smooth colour field, textures of ~16-px and ~2-px features, noise of 5 levels. At
    quality 90: about 75 KB at 500x375 and 4.5 MB at 4000x3000 (ImageNet's files average about 110 KB; a phone's
    12-MP photo is 3-5 MB)."""
    coarse = rng.uniform(20, 235, (int(rng.integers(2, 6)), int(rng.integers(2, 6)), 3)).astype(np.uint8)
    pixels = np.asarray(Image.fromarray(coarse).resize((width, height), Image.Resampling.BICUBIC), np.float32)
    for feature, amplitude in ((16, rng.uniform(10, 30)), (2, rng.uniform(10, 25))):
        texture = rng.standard_normal((max(2, height // feature), max(2, width // feature)), dtype=np.float32)
        texture = np.asarray(Image.fromarray(texture).resize((width, height), Image.Resampling.BICUBIC))
        pixels += texture[..., None] * amplitude
    pixels += rng.standard_normal((height, width, 1), dtype=np.float32) * 5.0
    buffer = io.BytesIO()
    Image.fromarray(np.clip(pixels, 0, 255).astype(np.uint8)).save(buffer, "JPEG", quality=QUALITY)
    return buffer.getvalue()


def _write_chunk(task: tuple[str, str, int, float, list[int]]) -> list[tuple[str, int, int, int]]:
    """Pool task: one split's files with the given indexes; (path, width, height, bytes) of each."""
    folder, split, seed, scale, indexes = task
    written = []
    for index in indexes:
        rng = np.random.default_rng([seed, 0 if split == "train" else 1, index])
        width, height = draw_size(rng, scale)
        name = os.path.join(split, f"class_{index % CLASSES}", f"{index:06d}.jpg")
        data = render(width, height, rng)
        Path(folder, name).write_bytes(data)
        written.append((name, width, height, len(data)))
    return written


def folder_for(root: Path, counts: tuple[int, int], seed: int = 0, scale: float = 1.0) -> Path:
    """Where `ensure_folder` puts the folder of these files: a name that holds everything they depend on."""
    return Path(root, f"v{FORMAT_VERSION}-train{counts[0]}-val{counts[1]}-big{BIG_SHARE}-scale{scale}-seed{seed}")


def ensure_folder(root: Path, counts: tuple[int, int], seed: int = 0, scale: float = 1.0, processes: int = 1) -> Path:
    """`folder_for(...)` holding train/ and val/ ImageFolder trees of `counts` files, generated once by
    `processes` processes (the GPU box: all its cores)."""
    final = folder_for(root, counts, seed, scale)
    if final.is_dir():
        return final
    tmp = Path(root, f".tmp-{final.name}-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    try:
        for split in ("train", "val"):
            for label in range(CLASSES):
                (tmp / split / f"class_{label}").mkdir(parents=True)
        tasks = [
            (str(tmp), split, seed, scale, list(range(first, min(first + 64, count))))
            for split, count in zip(("train", "val"), counts, strict=True)
            for first in range(0, count, 64)
        ]
        ctx = multiprocessing.get_context("fork" if sys.platform.startswith("linux") else None)
        with ctx.Pool(max(1, processes)) as pool:
            written = [row for chunk in pool.imap_unordered(_write_chunk, tasks) for row in chunk]
        sizes = sorted(row for row in written if row[0].startswith("train"))
        (tmp / "sizes.json").write_text(json.dumps({"scale": scale, "train": sizes}))
        os.rename(tmp, final)  # atomic: readers see either nothing or the complete tree
    except OSError:
        if not final.is_dir():
            raise  # else another process published the same tree first: its files are identical
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final


def describe(folder: Path) -> dict:
    """What the folder holds, for the tables: files, mean KB, mean and median size, the 12-MP share."""
    listed = json.loads(Path(folder, "sizes.json").read_text())
    rows, scale = listed["train"], listed["scale"]
    widths, heights = np.array([r[1] for r in rows]), np.array([r[2] for r in rows])
    pixels = widths * heights
    big = [round(side * scale) for side in BIG]
    is_big = pixels >= big[0] * big[1]
    return {
        "root": str(folder),
        "train_files": len(rows),
        "val_files": sum(1 for _ in Path(folder, "val").rglob("*.jpg")),
        "mean_kb": float(np.mean([r[3] for r in rows]) / 1e3),
        "mean_size": [float(widths.mean()), float(heights.mean())],
        "mean_size_without_big": [float(widths[~is_big].mean()), float(heights[~is_big].mean())],
        "median_pixels": float(np.median(pixels)),
        "big_size": big,
        "big_share": float(is_big.mean()),
        "big_share_of_pixels": float(pixels[is_big].sum() / pixels.sum()),
        "distribution": (
            f"{BIG_SHARE:.0%} at {big[0]}x{big[1]}; the rest {round(LONG_SIDE * scale)} px on the long side (70%) "
            f"or log-uniform {round(100 * scale)}-{round(800 * scale)} px, aspect 4:3/3:2/1:1/1-2, a quarter portrait"
        ),
    }


def summary(described: dict) -> str:
    """One sentence for a table's notes."""
    width, height = described["mean_size_without_big"]
    return (
        f"{described['train_files']:,} training JPEGs (quality {QUALITY}), {described['mean_kb']:.0f} KB on average; "
        f"sizes: {described['distribution']} (mean {width:.0f}x{height:.0f} without the big ones); "
        f"{described['big_share']:.1%} of the files are {described['big_size'][0]}x{described['big_size'][1]} "
        f"({described['big_share_of_pixels']:.0%} of the pixels); read from the page cache"
    )
