"""What follows the batched crop (data/batched.py): the augmentation policy of dataset.augment, per sample, and
random erasing (dataset.random_erasing), per batch; and the seeded draws both take.

Every random number here is a pure function of the sample's seed, as the crop's are, so a resumed epoch and any
batch composition or worker draw the same ones. A sample's seed feeds one SplitMix64 counter (`uniforms`); its
crop reads the counter's first `batched.DRAWS` values, its policy's seed is value POLICY_DRAW, its erasing reads
ERASING_DRAWS values from ERASING_FIRST: disjoint parts of one stream, so the three are independent.

- The policy (TrivialAugmentWide, RandAugment, AutoAugment from torchvision.transforms.v2) runs per sample, its
  draws read from the sample's stream from POLICY_FIRST on (data/policy_draws.py), never from torch's generator, so
  loader threads draw the same as worker processes. A per-sample transform that draws from torch's default CPU
  generator itself (RandomErasing filling with noise, a user's own) runs with that generator set to the sample's
  seed (value POLICY_DRAW), under GENERATOR_LOCK: one thread at a time re-seeds and draws.
- Random erasing follows v2.RandomErasing's algorithm (the chance p, then up to 10 tries of an area share and a
  log-uniform aspect ratio, the first box strictly inside the image), drawn with NumPy for the whole batch and
  applied to the stacked batch, in the worker or on the device (data.augment_on): `erase`.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch.utils.data import get_worker_info
from torchvision.transforms import v2

from imgtrain.data.policy_draws import apply_drawn, draws_of

POLICY_DRAW = 1001  # the counter value (data/batched.py uses 1..23) whose uniform seeds a sample's generator
POLICY_FIRST = 1002  # the first of a policy's own draws (data/policy_draws.py: a few per operation, below 2001)
ERASING_TRIES = 10  # RandomErasing's attempts at a box strictly inside the image; none fits: nothing erased
ERASING_FIRST = 2001  # the first counter value of a sample's erasing draws
ERASING_DRAWS = 2 * ERASING_TRIES + 3  # whether to erase, area share and ratio per try, top, left
SEED_BITS = 53  # a policy seed: the 53 bits of its uniform
# Held while torch's default CPU generator is re-seeded and drawn from (`seeded`, train/mixing.py): the generator
# is the process's one, and loader threads share it. Uncontended in a worker process (one thread draws there).
GENERATOR_LOCK = threading.Lock()

# Transforms that change an image's size: after the crop they would break the batch's one size, so a transform
# holding one after the flip keeps the per-sample path (data/batched.py spec_of).
RESIZING = (
    v2.RandomResizedCrop,
    v2.Resize,
    v2.CenterCrop,
    v2.RandomCrop,
    v2.Pad,
    v2.RandomZoomOut,
    v2.RandomIoUCrop,
    v2.ScaleJitter,
    v2.RandomShortestSize,
    v2.RandomResize,
    v2.FiveCrop,
    v2.TenCrop,
)


@dataclass(frozen=True)
class ErasingSpec:
    """A v2.RandomErasing with a constant fill, as `erase_boxes` and `erase` apply it to a batch."""

    p: float  # per image, the chance of one rectangle
    scale: tuple[float, float]  # its area, as a share of the image's
    ratio: tuple[float, float]  # its height over width (RandomErasing's convention)
    fill: tuple[float, ...]  # uint8 levels: one for every channel, or one per channel


def erasing_of(step: v2.RandomErasing) -> ErasingSpec | None:
    """`step` as an ErasingSpec; None when it fills with noise (value="random"), which stays per sample."""
    if step.value is None:
        return None
    return ErasingSpec(float(step.p), tuple(step.scale), tuple(step.ratio), tuple(float(v) for v in step.value))


def uniforms(seeds: np.ndarray, count: int, first: int = 1) -> np.ndarray:
    """[len(seeds), count] uniforms in [0, 1), each row a function of its seed alone: SplitMix64 of the seed and the
    counter values first..first+count-1."""
    counter = np.arange(first, first + count, dtype=np.uint64)
    with np.errstate(over="ignore"):  # uint64 arithmetic wraps by design
        x = np.asarray(seeds).astype(np.uint64)[:, None] * np.uint64(0x9E3779B97F4A7C15) + counter
        x = x * np.uint64(0x9E3779B97F4A7C15)
        x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        x ^= x >> np.uint64(31)
    return (x >> np.uint64(11)).astype(np.float64) / float(1 << 53)


def policy_seeds(seeds: np.ndarray) -> list[int]:
    """Each sample's seed for torch's generator while its policy runs (independent of its crop's draws)."""
    return [int(u * (1 << SEED_BITS)) for u in uniforms(seeds, 1, POLICY_DRAW)[:, 0]]


@contextlib.contextmanager
def own_generator() -> Iterator[None]:
    """Torch's default CPU generator free to re-seed: in a DataLoader worker as it is (each sample re-seeds it
    anyway), in the training process (num_workers=0) forked, so its own random stream is left untouched."""
    if get_worker_info() is not None:
        yield
        return
    with torch.random.fork_rng(devices=[]):
        yield


def seeded(seed: int, call: Callable[..., Any], *args: Any) -> Any:
    """`call(*args)` with torch's default CPU generator (which torchvision's random transforms draw from) set to
    `seed`. Seeding only that one: torch.manual_seed would also queue a CUDA re-seed and format a stack trace, ~90 us
    per call."""
    with GENERATOR_LOCK, own_generator():
        torch.random.default_generator.manual_seed(seed)
        return call(*args)


def apply_policy(images: list[torch.Tensor], seeds: np.ndarray | None, policy: Sequence[Any]) -> list[torch.Tensor]:
    """Each uint8 image [3, S, S] through the `policy` transforms in turn, each drawing from the image's seed
    (`seeds` None: from torch's generator as it is). Per sample: the policies draw their operations one image at
    a time, and most of their kernels take one image."""
    if not policy:
        return images
    if seeds is None:
        return [_through(image, policy) for image in images]
    counts = [draws_of(step) for step in policy]
    drawn = uniforms(seeds, max(1, sum(count or 0 for count in counts)), POLICY_FIRST)
    generator_seeds = policy_seeds(seeds) if None in counts else [0] * len(images)
    out = []
    for image, row, generator_seed in zip(images, drawn, generator_seeds, strict=True):
        first = 0
        for position, (step, count) in enumerate(zip(policy, counts, strict=True)):
            if count is None:  # a transform that draws from torch's generator itself
                image = seeded(generator_seed + position, step, image)
            else:
                image = apply_drawn(step, image, row[first : first + count])
                first += count
        out.append(image)
    return out


def _through(image: torch.Tensor, policy: Sequence[Any]) -> torch.Tensor:
    for step in policy:
        image = step(image)
    return image


def erase_boxes(seeds: np.ndarray, spec: ErasingSpec, size: int) -> np.ndarray:
    """[B, 4] int64 (top, left, height, width) in a size x size crop: each seed's rectangle, as RandomErasing draws
    it; height and width 0 where the image keeps all its pixels (its chance failed, or no try fitted)."""
    draws = uniforms(seeds, ERASING_DRAWS, ERASING_FIRST)
    area = float(size * size)
    share = draws[:, 1 : 1 + ERASING_TRIES] * (spec.scale[1] - spec.scale[0]) + spec.scale[0]
    log_low, log_high = np.log(spec.ratio[0]), np.log(spec.ratio[1])
    aspect = np.exp(draws[:, 1 + ERASING_TRIES : 1 + 2 * ERASING_TRIES] * (log_high - log_low) + log_low)
    h = np.rint(np.sqrt(area * share * aspect)).astype(np.int64)  # Python's round: half to even, as np.rint
    w = np.rint(np.sqrt(area * share / aspect)).astype(np.int64)
    fits = (h < size) & (w < size)
    first = fits.argmax(axis=1)  # the first try that fits, as RandomErasing takes it
    rows = np.arange(len(seeds))
    h, w = h[rows, first], w[rows, first]
    top = np.floor(draws[:, -2] * (size - h + 1)).astype(np.int64)
    left = np.floor(draws[:, -1] * (size - w + 1)).astype(np.int64)
    boxes = np.stack([top, left, h, w], axis=1)
    boxes[~((draws[:, 0] < spec.p) & fits.any(axis=1))] = 0
    return boxes


def erase(images: torch.Tensor, boxes: torch.Tensor, fill: Sequence[float]) -> torch.Tensor:
    """`images` [B, C, H, W] (uint8, or float in 0..255 levels) with each image's box [B, 4] (top, left, height,
    width; on their device) set to `fill`, in place. On a GPU one mask for the batch (`erase_masked`: a kernel per
    channel value, no sync); on the CPU a slice per erased image (`erase_slices`), which touches the boxes alone.
    Measured on the 2-core development machine, one thread, 256 crops of 224 px, p=0.25: 0.0024 ms per image
    against 0.10 for the masked fill, which writes every pixel of the batch (v2.RandomErasing per sample: 0.028)."""
    if images.device.type == "cpu":
        return erase_slices(images, boxes, fill)
    return erase_masked(images, boxes, fill)


def erase_masked(images: torch.Tensor, boxes: torch.Tensor, fill: Sequence[float]) -> torch.Tensor:
    """`erase` as one mask [B, H, W] and one masked fill per channel value, whatever the batch: no host sync."""
    height, width = images.shape[-2:]
    top, left, h, w = (boxes[:, k, None] for k in range(4))
    rows = torch.arange(height, device=images.device)[None, :]
    cols = torch.arange(width, device=images.device)[None, :]
    mask = ((rows >= top) & (rows < top + h))[:, :, None] & ((cols >= left) & (cols < left + w))[:, None, :]
    if len(fill) == 1:
        return images.masked_fill_(mask[:, None], fill[0])
    for channel, value in enumerate(fill):
        images[:, channel].masked_fill_(mask, value)
    return images


def erase_slices(images: torch.Tensor, boxes: torch.Tensor, fill: Sequence[float]) -> torch.Tensor:
    """`erase` as one slice assignment per erased image (the boxes read on the host: for CPU tensors)."""
    value = torch.tensor(fill, dtype=images.dtype, device=images.device)[:, None, None]
    for i, (top, left, h, w) in enumerate(boxes.tolist()):
        if h and w:
            images[i, :, top : top + h, left : left + w] = value
    return images
