"""The `shapes` dataset: 10 classes of drawn shapes, written once as JPEG files in an ImageFolder layout.

Each image is one filled shape (random colour, position, size, aspect, rotation) over a gradient background
with noise and thin clutter lines. Generation is deterministic given the seed, runs in a process pool and is
published with an atomic rename, so several processes (DDP ranks) may call `ensure_shapes` at once.
This module imports no torch, so pool workers start quickly.
"""

from __future__ import annotations

import logging
import math
import multiprocessing
import os
import shutil
import sys
import time
import uuid

import numpy as np
from PIL import Image, ImageDraw

from imgtrain.host.cpus import available_cpus

log = logging.getLogger(__name__)

FORMAT_VERSION = 2  # bump when the drawing changes, so existing caches are regenerated
CLASSES = (
    "circle",
    "ring",
    "triangle",
    "square",
    "pentagon",
    "hexagon",
    "star",
    "cross",
    "crescent",
    "heart",
)
SPLITS = ("train", "val")
SUPERSAMPLE = 2  # the shape mask is drawn at 2x and downsampled: anti-aliased edges
JPEG_QUALITY = 90
POOL_MIN_IMAGES = 400  # below this, one process is faster than starting a pool
# Difficulty: a ResNet-18 trained from scratch for a few epochs should do well above chance, but not 100%.
RADIUS = (0.28, 0.42)  # shape radius, as a fraction of the image side
BG_MAX = 150  # background channels lie in [0, BG_MAX], shape channels in [255 - BG_MAX, 255]
MIN_CONTRAST = 150  # minimum difference of channel sums (0..765) between the shape and the background
BG_SPREAD = 40  # how far the second gradient colour may differ from the first, per channel
NOISE = (2, 10)  # range of the gaussian pixel noise's standard deviation
CLUTTER = (0, 3)  # range of the number of thin random lines drawn over the image


def dataset_key(image_size: int, num_train: int, num_val: int, seed: int) -> str:
    """Directory name that encodes everything the generated files depend on."""
    return f"v{FORMAT_VERSION}-{image_size}px-train{num_train}-val{num_val}-seed{seed}"


# ----------------------------------------------------------------------------- drawing
def _regular(n: int, inner: float | None = None) -> np.ndarray:
    """Vertices of a regular n-gon (or an n-pointed star with the given inner radius) on the unit circle."""
    if inner is None:
        angles = np.arange(n) * 2 * math.pi / n
        return np.stack([np.cos(angles), np.sin(angles)], axis=1)
    angles = np.arange(2 * n) * math.pi / n
    radii = np.where(np.arange(2 * n) % 2 == 0, 1.0, inner)
    return np.stack([radii * np.cos(angles), radii * np.sin(angles)], axis=1)


def _cross(arm: float) -> np.ndarray:
    """A plus sign with half-width `arm` (unit half-length)."""
    a = arm
    pts = [(a, -1), (a, -a), (1, -a), (1, a), (a, a), (a, 1), (-a, 1), (-a, a), (-1, a), (-1, -a), (-a, -a)]
    return np.array([(-a, -1), *pts], dtype=np.float64)


def _heart() -> np.ndarray:
    """The classic parametric heart, scaled to about the unit circle, point down."""
    t = np.linspace(0, 2 * math.pi, 48, endpoint=False)
    x = 16 * np.sin(t) ** 3
    y = 13 * np.cos(t) - 5 * np.cos(2 * t) - 2 * np.cos(3 * t) - np.cos(4 * t)
    return np.stack([x / 17.0, -(y + 3) / 15.0], axis=1)


def _outlines(label: str, rng: np.random.Generator) -> list[tuple[np.ndarray, int]]:
    """Unit-sized polygons for one class, each with the mask value it paints (255 = shape, 0 = hole)."""
    circle = _regular(40)
    if label == "circle":
        return [(circle, 255)]
    if label == "ring":
        return [(circle, 255), (circle * rng.uniform(0.5, 0.65), 0)]
    if label == "star":
        return [(_regular(5, inner=rng.uniform(0.38, 0.5)), 255)]
    if label == "cross":
        return [(_cross(rng.uniform(0.26, 0.36)), 255)]
    if label == "crescent":
        shift = np.array([rng.uniform(0.35, 0.55), rng.uniform(-0.1, 0.1)])
        return [(circle, 255), (circle * rng.uniform(0.85, 1.0) + shift, 0)]
    if label == "heart":
        return [(_heart(), 255)]
    sides = {"triangle": 3, "square": 4, "pentagon": 5, "hexagon": 6}[label]
    return [(_regular(sides), 255)]


def _shape_mask(label: str, size: int, rng: np.random.Generator) -> np.ndarray:
    """Float mask in 0..1 of one randomly placed, scaled, stretched and rotated shape."""
    big = size * SUPERSAMPLE
    radius = rng.uniform(*RADIUS) * big
    centre = rng.uniform(0.5 * radius, big - 0.5 * radius, size=2)
    centre = 0.5 * centre + 0.25 * big  # keep most of the shape inside the frame
    aspect = rng.uniform(0.8, 1.25)
    angle = rng.uniform(0, 2 * math.pi)
    rot = np.array([[math.cos(angle), -math.sin(angle)], [math.sin(angle), math.cos(angle)]])
    scale = np.array([radius * aspect, radius / aspect])
    mask = Image.new("L", (big, big), 0)
    draw = ImageDraw.Draw(mask)
    for points, value in _outlines(label, rng):
        xy = (points * scale) @ rot.T + centre
        draw.polygon([tuple(p) for p in xy.tolist()], fill=value)
    mask = mask.resize((size, size), Image.Resampling.BOX)
    return np.asarray(mask, dtype=np.float32) / 255.0


def _colours(rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Two darker background colours (a gradient) and a brighter foreground colour, all of random hue."""
    bg0 = rng.uniform(0, BG_MAX, size=3)
    bg1 = np.clip(bg0 + rng.uniform(-BG_SPREAD, BG_SPREAD, size=3), 0, BG_MAX)
    while True:  # a consistent polarity (bright on dark) lets a small network learn the shapes quickly
        fg = rng.uniform(255 - BG_MAX, 255, size=3)
        if fg.sum() - max(bg0.sum(), bg1.sum()) > MIN_CONTRAST:
            return bg0, bg1, fg


def render(label_index: int, size: int, rng: np.random.Generator) -> Image.Image:
    """Draw one RGB image of class CLASSES[label_index]."""
    bg0, bg1, fg = _colours(rng)
    mask = _shape_mask(CLASSES[label_index], size, rng)[..., None]
    direction = rng.uniform(0, 2 * math.pi)
    ramp = np.linspace(-0.5, 0.5, size, dtype=np.float32)
    t = (math.cos(direction) * ramp[None, :] + math.sin(direction) * ramp[:, None] + 0.5)[..., None]
    background = bg0 * (1 - t) + bg1 * t
    image = background * (1 - mask) + fg * mask
    image += rng.standard_normal(image.shape, dtype=np.float32) * rng.uniform(*NOISE)
    picture = Image.fromarray(np.clip(image, 0, 255).astype(np.uint8), "RGB")
    draw = ImageDraw.Draw(picture)
    for _ in range(int(rng.integers(*CLUTTER))):  # thin clutter lines, some across the shape
        x0, y0, x1, y1 = (rng.uniform(0, size, size=4)).tolist()
        colour = tuple(int(c) for c in rng.integers(0, 256, size=3))
        draw.line((x0, y0, x1, y1), fill=colour, width=max(1, size // 40))
    return picture


def _render_chunk(args: tuple[str, str, int, int, list[int]]) -> int:
    """Pool task: render and save the images with the given indexes of one split."""
    out_dir, split, size, seed, indexes = args
    for index in indexes:
        rng = np.random.default_rng([seed, SPLITS.index(split), index])
        label = index % len(CLASSES)
        path = os.path.join(out_dir, split, CLASSES[label], f"{index:06d}.jpg")
        render(label, size, rng).save(path, "JPEG", quality=JPEG_QUALITY)
    return len(indexes)


# ----------------------------------------------------------------------------- generation on disk
def _num_processes(total: int, most: int) -> int:
    if total < POOL_MIN_IMAGES:
        return 1
    return max(1, min(available_cpus(), most))


def _generate_into(out_dir: str, image_size: int, counts: dict[str, int], seed: int, processes: int) -> None:
    tasks = []
    for split, count in counts.items():
        for name in CLASSES:
            os.makedirs(os.path.join(out_dir, split, name))
        step = max(1, min(250, math.ceil(count / 16)))
        tasks += [
            (out_dir, split, image_size, seed, list(range(i, min(i + step, count)))) for i in range(0, count, step)
        ]
    processes = _num_processes(sum(counts.values()), processes)
    if processes == 1:
        for task in tasks:
            _render_chunk(task)
        return
    # fork is cheapest on Linux (workers only run numpy and PIL); elsewhere the platform default.
    ctx = multiprocessing.get_context("fork" if sys.platform.startswith("linux") else None)
    with ctx.Pool(processes) as pool:
        for _ in pool.imap_unordered(_render_chunk, tasks):
            pass


def ensure_shapes(root: str, image_size: int, num_train: int, num_val: int, seed: int, processes: int = 8) -> str:
    """Return `<root>/<key>` holding train/ and val/ ImageFolder trees, generating them on first use.

    At most `processes` CPUs draw (8 by default: training may start beside it; the benchmarks use them all).
    """
    root = os.path.abspath(os.path.expanduser(root))
    final = os.path.join(root, dataset_key(image_size, num_train, num_val, seed))
    if os.path.isdir(final):
        return final
    os.makedirs(root, exist_ok=True)
    tmp = os.path.join(root, f".tmp-{os.path.basename(final)}-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    start = time.perf_counter()
    try:
        _generate_into(tmp, image_size, {"train": num_train, "val": num_val}, seed, processes)
        os.rename(tmp, final)  # atomic: readers see either nothing or the complete tree
    except OSError:
        if not os.path.isdir(final):
            raise
        # another process published the same tree first; its files are identical, keep them
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    log.info(
        "generated the shapes dataset (%d train + %d val, %d px) at %s in %.1f s",
        num_train,
        num_val,
        image_size,
        final,
        time.perf_counter() - start,
    )
    return final
