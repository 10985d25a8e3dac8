"""Augmentation per batch (data/batched.py): RandomResizedCrop's distribution, the pixels of the per-sample path
within a stated bound, draws that depend on the seed alone, and the DataLoader path through it."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
import torchvision.transforms.v2.functional as F
from torch.utils.data import DataLoader
from torchvision.transforms import RandomResizedCrop, v2

from imgtrain.data import batched
from imgtrain.data.datasets import build_shapes, eval_transform, square_resize, train_transform
from imgtrain.data.samples import GuardedSamples, collate

DRAWS = 4000  # boxes per distribution: a KS test then sees a 3% shift of any quantile
P_MIN = 1e-3  # the draws are fixed (seeds 0..3999), so a pass or a failure is the same on every run


def _ours(height: int, width: int, scale: tuple[float, float], ratio: tuple[float, float]) -> np.ndarray:
    spec = batched.CropSpec(224, scale, ratio)
    sizes = np.full(DRAWS, height), np.full(DRAWS, width)
    return batched.random_boxes(*sizes, batched.uniforms(np.arange(DRAWS), batched.DRAWS), spec)


def _torchvisions(height: int, width: int, scale: tuple[float, float], ratio: tuple[float, float]) -> np.ndarray:
    image = torch.empty(3, height, width, dtype=torch.uint8)
    torch.manual_seed(0)
    return np.array([RandomResizedCrop.get_params(image, list(scale), list(ratio)) for _ in range(DRAWS)])


def _features(boxes: np.ndarray, height: int, width: int) -> dict[str, np.ndarray]:
    top, left, h, w = boxes.T.astype(float)
    return {
        "area": h * w / (height * width),
        "aspect": w / h,
        "top": (top + h / 2) / height,  # the box's centre, as a share of the image
        "left": (left + w / 2) / width,
    }


def _ks_2samp():
    """SciPy's two-sample Kolmogorov-Smirnov test (a dev dependency; the GPU box may lack it)."""
    return pytest.importorskip("scipy.stats", reason="needs SciPy (the dev extra)").ks_2samp


@pytest.mark.parametrize(
    ("height", "width", "scale", "ratio"),
    [
        (32, 32, (0.6, 1.0), (3 / 4, 4 / 3)),  # shapes
        (375, 500, (0.08, 1.0), (3 / 4, 4 / 3)),  # ImageNet's defaults, landscape
        (500, 375, (0.35, 1.0), (3 / 4, 4 / 3)),  # imagefolder's, portrait
        (64, 256, (0.08, 1.0), (0.5, 2.0)),  # a strip: many tries miss, some fall back to the centre crop
    ],
)
def test_boxes_follow_random_resized_crops_distribution(height, width, scale, ratio) -> None:
    ours, theirs = _ours(height, width, scale, ratio), _torchvisions(height, width, scale, ratio)
    assert (ours[:, 2] >= 1).all() and (ours[:, 0] + ours[:, 2] <= height).all()
    assert (ours[:, 3] >= 1).all() and (ours[:, 1] + ours[:, 3] <= width).all()
    a, b = _features(ours, height, width), _features(theirs, height, width)
    ks_2samp = _ks_2samp()
    for name in a:
        assert ks_2samp(a[name], b[name]).pvalue > P_MIN, name


def test_the_distribution_test_can_fail() -> None:
    """A scale range 10% narrower at its low end is told apart: the test above has the power it claims."""
    ours = _features(_ours(375, 500, (0.18, 1.0), (3 / 4, 4 / 3)), 375, 500)
    theirs = _features(_torchvisions(375, 500, (0.08, 1.0), (3 / 4, 4 / 3)), 375, 500)
    assert _ks_2samp()(ours["area"], theirs["area"]).pvalue < 1e-6


@pytest.fixture(scope="module")
def shapes_images(tmp_path_factory: pytest.TempPathFactory) -> list[torch.Tensor]:
    bundle = build_shapes("shapes", 32, [0.5] * 3, [0.25] * 3, True, str(tmp_path_factory.mktemp("s")), 256, 10, 0)
    return [bundle.train.decoded(i)[0] for i in range(256)]


def test_a_batch_of_small_images_matches_the_per_image_resize_within_a_bound(shapes_images) -> None:
    """One roi_align call for 256 shapes images against torchvision's antialiased resize per image, same boxes:
    both sample bilinearly at the same pixel centres; they differ in rounding and at the borders. Measured: mean
    0.20 levels, 99th percentile 1, 99.9th 8 (sharp edges at a border); bound: mean 0.5, 99th percentile 2."""
    spec = batched.spec_of(train_transform(32, min_scale=0.6))
    seeds = np.arange(256)
    boxes = batched.random_boxes(np.full(256, 32), np.full(256, 32), batched.uniforms(seeds, batched.DRAWS), spec)
    grouped = batched._roi_align_group(torch.stack(shapes_images), boxes, 32)
    pairs = zip(shapes_images, boxes, strict=True)
    per_image = torch.stack([F.resized_crop(im, *(int(v) for v in box), [32, 32], antialias=True) for im, box in pairs])
    difference = (grouped.float() - per_image.float()).abs().flatten()
    assert difference.mean() <= 0.5 and difference.kthvalue(int(0.99 * difference.numel())).values <= 2


def test_larger_and_mixed_sizes_take_torchvisions_own_kernel_exactly() -> None:
    generator = torch.Generator().manual_seed(0)
    images = [torch.randint(0, 256, (3, h, w), dtype=torch.uint8, generator=generator) for h, w in
              [(120, 90), (120, 90), (64, 80), (30, 30)]]  # fmt: skip
    spec = batched.spec_of(train_transform(48))
    seeds = np.array([5, 6, 7, 8])
    out = torch.stack(batched.augment_batch(images, seeds, spec))
    draws = batched.uniforms(seeds, batched.DRAWS)
    heights, widths = np.array([120, 120, 64, 30]), np.array([90, 90, 80, 30])
    boxes = batched.random_boxes(heights, widths, draws, spec)
    for i, (image, box) in enumerate(zip(images, boxes, strict=True)):
        expected = F.resized_crop(image, *(int(v) for v in box), [48, 48], antialias=True)
        assert torch.equal(out[i], expected.flip(-1) if draws[i, -1] < 0.5 else expected)


BOXES = [(0, 0, 75, 100), (5, 7, 48, 48), (10, 20, 30, 17), (3, 4, 60, 1), (0, 50, 1, 50), (12, 9, 51, 77)]


def test_the_crop_is_torchvisions_resized_crop_pixel_for_pixel_in_either_layout() -> None:
    """batched.resized_crop against torchvision's resized_crop, then flip: the same pixels for images as the CPU
    decoders give them (RGB rows: [3, H, W] viewed from [H, W, 3]) and planar ones, for the whole image, boxes of the
    output's size, smaller (upscaled), one pixel thin, and 200 drawn at random; the crop comes out channels-last."""
    generator = torch.Generator().manual_seed(2)
    rows = torch.randint(0, 256, (75, 100, 3), dtype=torch.uint8, generator=generator)
    drawn = batched.random_boxes(np.full(200, 75), np.full(200, 100), batched.uniforms(np.arange(200), batched.DRAWS),
                                 batched.CropSpec(48, (0.05, 1.0), (0.5, 2.0)))  # fmt: skip
    for image in (rows.permute(2, 0, 1), rows.permute(2, 0, 1).contiguous()):
        for i, box in enumerate([*BOXES, *(tuple(int(v) for v in box) for box in drawn)]):
            flip = i % 2 == 1
            expected = F.resized_crop(image, *box, [48, 48], antialias=True)
            out = batched.resized_crop(image, *box, 48, flip)
            assert torch.equal(out, expected.flip(-1) if flip else expected), (box, flip)
            assert out.stride(0) == 1, box  # channels-last: RGB after RGB


def test_the_crops_are_written_once_into_a_channels_last_batch_that_crosses_from_a_worker(tmp_path: Path) -> None:
    """collate's batch is the one the crops were written into (channels-last; in shared memory inside a worker, as
    default_collate's): a DataLoader worker hands over the same pixels as this process makes, in the same layout,
    and they are the per-sample crops stacked."""
    bundle = build_shapes("shapes", 64, [0.5] * 3, [0.25] * 3, True, str(tmp_path), 16, 10, 0)  # 64 px: per image
    samples, items = GuardedSamples(bundle.train), [(i, 1000 + i) for i in range(8)]
    here = collate(samples.__getitems__(items)).images
    there = next(iter(DataLoader(samples, batch_sampler=[items], num_workers=1, collate_fn=collate))).images
    assert torch.equal(there, here) and here.is_contiguous(memory_format=torch.channels_last)
    assert there.is_contiguous(memory_format=torch.channels_last)
    decoded = [bundle.train.decoded(i)[0] for i in range(8)]
    per_image = batched.augment_batch(decoded, np.arange(1000, 1008), bundle.train.crop_spec)
    assert torch.equal(here, torch.stack(per_image))
    assert batched.channels_last_batch(2, 8, decoded[0], shared=True).is_shared()


def test_evaluation_transforms_give_the_per_sample_pixels(shapes_images) -> None:
    image = torch.randint(0, 256, (3, 75, 100), dtype=torch.uint8, generator=torch.Generator().manual_seed(1))
    for transform, source in ((eval_transform(64), image), (square_resize(32), shapes_images[0])):
        out = torch.stack(batched.augment_batch([source, source], None, batched.spec_of(transform)))
        assert torch.equal(out[0], transform(source)) and torch.equal(out[1], out[0])


def test_each_samples_draws_depend_on_its_seed_alone(shapes_images) -> None:
    spec = batched.spec_of(train_transform(32, min_scale=0.6))
    seeds = np.arange(100, 164)
    whole = torch.stack(batched.augment_batch(shapes_images[:64], seeds, spec))
    halves = torch.stack([*batched.augment_batch(shapes_images[:32], seeds[:32], spec),
                          *batched.augment_batch(shapes_images[32:64], seeds[32:], spec)])  # fmt: skip
    assert torch.equal(whole, halves)  # the same, however the batch is cut
    assert torch.equal(whole, torch.stack(batched.augment_batch(shapes_images[:64], seeds, spec)))  # and on a rerun
    flips = batched.uniforms(np.arange(20_000), batched.DRAWS)[:, -1] < spec.flip_p
    assert abs(flips.mean() - 0.5) < 0.01


def test_which_transforms_are_batched() -> None:
    assert batched.spec_of(train_transform(224)) == batched.CropSpec(224, (0.35, 1.0), (3 / 4, 4 / 3), 0.5)
    assert batched.spec_of(eval_transform(224)) == batched.CropSpec(224, resize=256)
    assert batched.spec_of(square_resize(32)) == batched.CropSpec(32)
    assert batched.spec_of(v2.Compose([v2.RandomCrop(32, padding=4), v2.RandomHorizontalFlip()])) is None
    nearest = v2.RandomResizedCrop(32, interpolation=v2.InterpolationMode.NEAREST)
    assert batched.spec_of(nearest) is None


def test_the_dataloader_path_batches_and_keeps_unreadable_files_handled(tmp_path: Path) -> None:
    bundle = build_shapes("shapes", 32, [0.5] * 3, [0.25] * 3, True, str(tmp_path), 40, 10, 0)
    Path(bundle.train.path(3)).write_bytes(b"not a jpeg")
    samples = GuardedSamples(bundle.train, replace=True)
    items = [(i, 1000 + i) for i in range(8)]
    batch = collate(samples.__getitems__(items))
    assert batch.images.shape == (8, 3, 32, 32) and batch.images.dtype == torch.uint8
    assert [path for path, _ in batch.skipped] == [bundle.train.path(3)]
    assert batch.times.augment > 0 and batch.times.decode > 0 and batch.times.samples == 8
    again = collate(samples.__getitems__(items[4:]))  # another batch holding the same samples: the same pixels
    assert torch.equal(again.images, batch.images[4:])
    dropped = collate(GuardedSamples(bundle.train, replace=False).__getitems__(list(range(8))))
    assert dropped.images.shape[0] == 7
