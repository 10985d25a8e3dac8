"""Scaled decoding cropped on the device (data/resample.py) and by the workers (data/batched.py): the same boxes on
the smaller image's pixel grid, so the same pixels to the last row and column, not only on average."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from imgtrain.config.fields import AugmentOn
from imgtrain.data import batched, resample
from imgtrain.data.datasets import imagenet_transforms
from imgtrain.data.image_files import ImageFileDataset
from imgtrain.data.samples import GuardedSamples, collate

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from photos import render  # noqa: E402  benchmarks/photos.py: photo-like content at quality 90

SIZE = 96  # the crop: these photos decode at 1/2 to 1/8
# The two paths' kernels differ by torchvision's uint8 fixed-point rounding: at most 1 level (tests/test_resample.py)
ROUNDING = 1.01


@pytest.fixture(scope="module")
def photos(tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    """Landscape, portrait and a 4:3 photo whose reduced sides are not a whole fraction of the full ones."""
    root, rng = tmp_path_factory.mktemp("photos"), np.random.default_rng(0)
    paths = []
    for i, (width, height) in enumerate(((1600, 1200), (1200, 1600), (2003, 1501))):
        (path := root / f"{i}.jpg").write_bytes(render(width, height, rng))
        paths.append(str(path))
    return paths


def edges(difference: torch.Tensor) -> dict[str, float]:
    """The largest difference [B, C, H, W] on each edge of the crops, and inside them."""
    return {
        "first row": difference[..., 0, :].max().item(),
        "last row": difference[..., -1, :].max().item(),
        "first column": difference[..., 0].max().item(),
        "last column": difference[..., -1].max().item(),
        "inside": difference[..., 1:-1, 1:-1].max().item(),
    }


@pytest.mark.parametrize("split", ["train", "val"])
def test_the_device_crops_scaled_images_as_the_workers_do_to_the_edges(photos: list[str], split: str) -> None:
    """Each training box drawn on the full size, then on the smaller image's pixel grid on both paths; validation
    resizes the smaller image itself on both. Before the device path rounded its boxes, its fractional boxes lost
    their last weighted pixel to the windows' truncation: up to 172 levels apart on the edges."""
    transform = imagenet_transforms(SIZE, mean=(0.5, 0.5, 0.5))[0 if split == "train" else 1]
    items = [(i % 3, 1000 + i) for i in range(24)] if split == "train" else [0, 1, 2]
    outputs = {}
    for augment_on in (AugmentOn.workers, AugmentOn.device):
        dataset = ImageFileDataset(photos, [0, 1, 2], list("abc"), transform, scaled=True)
        samples = GuardedSamples(dataset, augment_on=augment_on).__getitems__(items)
        assert all(sample[0].full is not None for sample in samples)  # every photo decoded smaller
        batch = collate(samples).images
        outputs[augment_on] = (batch.resampled() if augment_on == AugmentOn.device else batch).float()
    worst = edges((outputs[AugmentOn.device] - outputs[AugmentOn.workers]).abs())
    assert max(worst.values()) <= ROUNDING, worst


def test_plans_of_reduced_images_are_whole_pixels_inside_them() -> None:
    """The boxes `plan_batch` gives for reduced images are the workers' (`batched.map_boxes`), whole pixels."""
    full = np.array([[1501, 2003], [1600, 1200]] * 8)
    heights, widths = -(-full[:, 0] // 8), -(-full[:, 1] // 8)  # libjpeg-turbo's 1/8: sides rounded up
    spec, seeds = batched.CropSpec(SIZE, (0.08, 1.0), flip_p=0.5), np.arange(16) * 11 + 5
    plan = resample.plan_batch(heights, widths, seeds, spec, full)
    draws = batched.uniforms(seeds, batched.DRAWS)
    boxes = batched.map_boxes(batched.random_boxes(full[:, 0], full[:, 1], draws, spec), full, heights, widths)
    assert np.array_equal(plan[:, [0, 5, 1, 6]], boxes)  # top, left, height, width
    assert (plan[:, 0] + plan[:, 1] <= heights).all() and (plan[:, 5] + plan[:, 6] <= widths).all()
    assert np.allclose(plan[:, 2] * SIZE, plan[:, 1]) and np.allclose(plan[:, 7] * SIZE, plan[:, 6])


def test_a_window_keeps_the_last_pixel_of_a_box_between_pixels() -> None:
    """A plan whose box starts and ends between pixels (a fork's): the windows reach outward to whole pixels, so
    the bounded path (windows, chunks) gives the whole canvas's crops. Truncated windows: 222 levels apart."""
    rng = np.random.default_rng(3)
    images = [torch.from_numpy(rng.integers(0, 256, (3, 150, 200), dtype=np.uint8)) for _ in range(6)]
    plan = resample.plan_batch(*resample.sizes_of(images), np.arange(6), batched.CropSpec(SIZE, (0.3, 1.0)))
    plan[:, [0, 1, 5, 6]] -= 0.37  # start and length: the box from 0.37 px before its pixels, its end as much
    plan[:, [0, 5]] = np.maximum(plan[:, [0, 5]], 0.0)
    whole = resample.resample(torch.stack(images), torch.from_numpy(plan), SIZE)
    bounded = resample.resample_images(images, plan, SIZE, budget=1)  # each image's window alone
    worst = edges((whole - bounded).abs())
    # Not to the bit: the window's positions minus a fractional start round otherwise in float32 (measured 0.0016)
    assert max(worst.values()) <= 0.01, worst
