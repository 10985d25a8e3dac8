"""The device half of the batched input path (data/resample.py): torchvision's crops and resizes as two matmuls for
a whole batch of mixed sizes, data.augment_on=device through the loader and the feed, and in-memory datasets
(CIFAR, synthetic) transformed a batch at a time."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
import torchvision.transforms.v2.functional as F
from helpers import compose_cfg
from torchvision.transforms import v2

from imgtrain.config.fields import AugmentOn
from imgtrain.data import batched, resample
from imgtrain.data.datasets import TensorImageDataset, build_shapes, square_resize, train_transform
from imgtrain.data.feed import Feed
from imgtrain.data.samples import GuardedSamples, RawBatch, RawImage, collate
from imgtrain.train.run import run

SIZES = [(375, 500), (500, 375), (300, 300), (480, 640), (150, 200), (90, 120), (48, 64), (40, 30)]  # (H, W)
SPECS = {
    "random resized crop and flip": batched.CropSpec(224, (0.08, 1.0), flip_p=0.5),
    "small crops": batched.CropSpec(32, (0.35, 1.0), flip_p=0.5),
    "short side and centre crop": batched.CropSpec(224, resize=256),
    "centre crop larger than the resized image (padding)": batched.CropSpec(224, resize=160),
    "square resize": batched.CropSpec(64),
}


@pytest.fixture(scope="module")
def mixed_images() -> list[torch.Tensor]:
    """Textured images of eight sizes: smooth gradients plus pixel noise, the worst case for resize kernels."""
    rng = np.random.default_rng(0)
    images = []
    for height, width in SIZES:
        y, x = np.mgrid[0:height, 0:width]
        smooth = np.stack([x * 255 / width, y * 255 / height, (x + y) * 127 / (width + height)])
        images.append(torch.from_numpy(np.clip(smooth + rng.normal(0, 30, smooth.shape), 0, 255).astype(np.uint8)))
    return images


def _per_image(
    images: list[torch.Tensor], seeds: np.ndarray, spec: batched.CropSpec, dtype=torch.uint8
) -> torch.Tensor:
    """torchvision's own kernels, image by image, with the boxes and flips the seeds draw."""
    if spec.scale is None:
        return torch.stack([batched._evaluation_crop(image.to(dtype), spec) for image in images]).float()
    draws = batched.uniforms(seeds, batched.DRAWS)
    out = []
    for image, box, flip in zip(
        images, batched.image_boxes(images, draws, spec), draws[:, -1] < spec.flip_p, strict=True
    ):
        crop = F.resized_crop(image.to(dtype), *(int(v) for v in box), [spec.size, spec.size], antialias=True)
        out.append(crop.flip(-1) if flip else crop)
    return torch.stack(out).float()


@pytest.mark.parametrize("name", list(SPECS))
def test_one_batch_of_mixed_sizes_matches_torchvision_per_image(mixed_images, name) -> None:
    """Float32: torchvision's float kernel to 1e-3 (the same weights); its uint8 kernel within its rounding, 1 level.
    Float16 (the CUDA default) within 1.25 levels of the uint8 kernel. Measured: float32 max 0.99-1.00 and mean
    0.19-0.30 against uint8; float16 max 1.00 (1.00-1.125 with af14a6e's rows-first order)."""
    spec, seeds = SPECS[name], np.arange(len(mixed_images)) * 7 + 3
    plan = torch.from_numpy(resample.plan_batch(*resample.sizes_of(mixed_images), seeds, spec))
    canvas = resample.canvas(mixed_images)
    assert canvas.shape == (8, 3, 500, 640)
    out = resample.resample(canvas, plan, spec.size)
    assert out.shape == (8, 3, spec.size, spec.size) and out.dtype == torch.float32
    assert (out - _per_image(mixed_images, seeds, spec, torch.float32)).abs().max() < 1e-3
    uint8 = _per_image(mixed_images, seeds, spec)
    assert (out - uint8).abs().max() <= 1.01  # measured up to 1.0002: the uint8 kernel's fixed-point weights
    half = resample.resample(canvas, plan, spec.size, torch.float16).float()
    assert (half - uint8).abs().max() <= 1.25
    decoded = resample.resample_images(mixed_images, plan.numpy(), spec.size)  # the decode path: windows, chunks
    assert decoded.dtype == torch.float32 and (decoded - uint8).abs().max() <= 1.01
    half = resample.resample_images(mixed_images, plan.numpy(), spec.size, torch.float16).float()
    assert (half - uint8).abs().max() <= 1.25


BOUNDED = {"training": SPECS["random resized crop and flip"], "evaluation": SPECS["short side and centre crop"]}
# af14a6e's computation against the bounded one: the same weights (test_windows_...), other float roundings. Float32:
# other summation orders (columns first, other matmul blocking), 1.5e-5 levels a rounding at 255; measured 1.4e-4
# against the batch's one canvas, 4.6e-5 against each image's own (2026-11-27).
# Float16: either order rounds its intermediate and its output to float16, half a step (0.0625 levels from 128 to
# 256) each, so the two differ by at most 0.25; measured 0.25.
TOLERANCE = {torch.float32: 1e-3, torch.float16: 0.25}
SMALL_BUDGET = 2 * 2**20  # bytes: three chunks of the batch below, the large image alone (2.5 MB in float16)


def _unbounded(images: list[torch.Tensor], plan: np.ndarray, size: int, dtype: torch.dtype) -> torch.Tensor:
    """af14a6e's `resample`: each whole image, the row weights broadcast over the channels, rows first. Each image on
    a canvas of its own size, not af14a6e's one canvas of the batch's largest: the same weights on its pixels
    (axis_weights: to the bit whatever the length) and none on the padding, for a quarter of the products with the
    photo below (float16 matmuls are slow on the CPU: 6 s on one thread for a canvas of 960x1280 photos)."""
    out = []
    for image, row in zip(images, torch.from_numpy(plan).float(), strict=True):
        row = row[None]
        rows = resample.axis_weights(row[:, :5], size, image.shape[-2]).to(dtype)
        cols = resample.axis_weights(row[:, 5:10], size, image.shape[-1], row[:, 10]).to(dtype)
        out.append(rows[:, None] @ image[None].to(dtype) @ cols[:, None].transpose(-1, -2))
    return torch.cat(out)


@pytest.fixture(scope="module")
def with_a_photo(mixed_images) -> list[torch.Tensor]:
    """The eight sizes (portrait and landscape) and one large image, last."""
    # 720x960: its windows alone exceed SMALL_BUDGET as 960x1280's did, the same chunks, half the float16 products
    photo = torch.randint(0, 256, (3, 720, 960), generator=torch.Generator().manual_seed(1), dtype=torch.uint8)
    return [*mixed_images, photo]


def _canvases(monkeypatch) -> list[torch.Tensor]:
    """Every canvas the two products are given, as it is made."""
    made, products = [], resample._two_products

    def recorded(make, *args):
        return products(lambda: made.append(make()) or made[-1], *args)

    monkeypatch.setattr(resample, "_two_products", recorded)
    return made


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("name", list(BOUNDED))
def test_the_bounded_path_gives_the_unbounded_ones_crops(with_a_photo, name, dtype) -> None:
    """Decode path (windows, chunks) and augment_on=device (the worker's window canvas, consecutive chunks)."""
    spec, seeds = BOUNDED[name], np.arange(len(with_a_photo)) * 5 + 1
    plan = resample.plan_batch(*resample.sizes_of(with_a_photo), seeds, spec)
    expected = _unbounded(with_a_photo, plan, spec.size, dtype)
    for budget in (resample.CHUNK_BYTES, SMALL_BUDGET):
        decoded = resample.resample_images(with_a_photo, plan, spec.size, dtype, budget)
        assert decoded.dtype == dtype and (decoded.float() - expected.float()).abs().max() <= TOLERANCE[dtype]
    items = [(RawImage(image, row, spec.size), 0, (), None) for image, row in zip(with_a_photo, plan, strict=True)]
    raw = collate(items).images
    assert raw.images.shape[-2:] != resample.canvas(with_a_photo).shape[-2:]  # windows, not whole images
    on_device = resample.resample(raw.images, raw.plan, spec.size, dtype, SMALL_BUDGET)
    assert (on_device.float() - expected.float()).abs().max() <= TOLERANCE[dtype]


@pytest.mark.parametrize("name", list(BOUNDED))
def test_windows_hold_every_pixel_the_weights_reach_and_little_more(with_a_photo, name) -> None:
    spec = BOUNDED[name]
    plan = resample.plan_batch(*resample.sizes_of(with_a_photo), np.arange(len(with_a_photo)) * 5 + 1, spec)
    bounds, (heights, widths) = resample.windows(plan, spec.size), resample.sizes_of(with_a_photo)
    changed = [255 - image for image in with_a_photo]
    for image, new, (top, bottom, left, right) in zip(with_a_photo, changed, bounds, strict=True):
        new[:, top:bottom, left:right] = image[:, top:bottom, left:right]  # only outside the window
    # Float32 alone: float16's weights are these rounded, so one that is not zero is a float32 one that is not, which
    # `reach` below finds outside the window as well as this product does.
    assert torch.equal(
        _unbounded(changed, plan, spec.size, torch.float32), _unbounded(with_a_photo, plan, spec.size, torch.float32)
    )
    rows = resample.axis_weights(torch.from_numpy(plan[:, :5]).float(), spec.size, heights.max())
    cols = resample.axis_weights(torch.from_numpy(plan[:, 5:10]).float(), spec.size, widths.max())
    for reach, low, high in ((rows, bounds[:, 0], bounds[:, 1]), (cols, bounds[:, 2], bounds[:, 3])):
        used = (reach > 0).any(1).numpy()
        first, last = used.argmax(1), used.shape[1] - used[:, ::-1].argmax(1)
        assert (low <= first).all() and (first - low <= 2).all() and (high >= last).all() and (high - last <= 2).all()
    cut, shifted = resample.crop_to_windows(with_a_photo, plan, spec.size)
    for i, window in enumerate(cut):  # the window's weights are the whole canvas's, to the bit
        top, left = bounds[i, 0], bounds[i, 2]
        got = resample.axis_weights(torch.from_numpy(shifted[i : i + 1, :5]).float(), spec.size, window.shape[-2])
        assert torch.equal(got[0], rows[i, :, top : top + window.shape[-2]])
        got = resample.axis_weights(torch.from_numpy(shifted[i : i + 1, 5:10]).float(), spec.size, window.shape[-1])
        assert torch.equal(got[0], cols[i, :, left : left + window.shape[-1]])


def test_a_budget_splits_the_batch_and_each_canvas_stays_under_it(with_a_photo, monkeypatch) -> None:
    spec, budget = BOUNDED["training"], SMALL_BUDGET
    plan = resample.plan_batch(*resample.sizes_of(with_a_photo), np.arange(len(with_a_photo)) * 5 + 1, spec)
    made = _canvases(monkeypatch)
    out = resample.resample_images(with_a_photo, plan, spec.size, torch.float16, budget)
    assert len(made) >= 3 and all(c.nbytes <= budget or len(c) == 1 for c in made) and made[0].dtype == torch.float16
    assert sum(len(canvas) for canvas in made) == len(with_a_photo) and out.shape == (9, 3, 224, 224)
    made.clear()
    shipped = resample.canvas(with_a_photo)  # the device path: a canvas as shipped, consecutive slots
    resample.resample(shipped, torch.from_numpy(plan), spec.size, torch.float16, 4 * shipped[0].numel() * 2)
    assert [len(canvas) for canvas in made] == [4, 4, 1] and all(c.nbytes <= 4 * shipped[0].numel() * 2 for c in made)


@pytest.mark.parametrize(("side", "dtype"), [(32, torch.float32), (32, torch.float16), (384, torch.float16)])
def test_a_batch_of_same_size_images_is_one_chunk(side, dtype) -> None:
    """256 images of one size, up to 384 px in float16 (226 MB): one stack, one pair of products."""
    images = [torch.empty((3, side, side), dtype=torch.uint8, device="meta") for _ in range(256)]
    plan = resample.plan_batch(*resample.sizes_of(images), np.arange(256), batched.CropSpec(min(side, 224), (0.35, 1)))
    chunks = resample.chunk_windows(images, plan, min(side, 224), 3 * dtype.itemsize, resample.CHUNK_BYTES)
    assert len(chunks) == 1 and chunks[0].windows is images


@pytest.mark.parametrize("name", list(BOUNDED))
def test_one_large_photo_does_not_multiply_the_working_memory(name) -> None:
    """255 ImageNet-sized images and one 4000x3000 photo, float16 as on CUDA, counted by torch's MemTracker without
    allocating (FakeTensorMode): beside the images and the output, at most twice CHUNK_BYTES (the canvas, then the
    intermediate and the weights: CHUNK_BYTES' comment). af14a6e needed 31 GB here (BENCHMARKS.md, 2026-11-25)."""
    from torch._subclasses import FakeTensorMode
    from torch.distributed._tools.mem_tracker import MemTracker

    sizes = [(375, 500), (500, 375)] * 127 + [(375, 500), (3000, 4000)]
    plan = resample.plan_batch(*(np.array(side) for side in zip(*sizes, strict=True)), np.arange(256), BOUNDED[name])
    with FakeTensorMode(allow_non_fake_inputs=True):
        tracker = MemTracker()
        with tracker:
            images = [torch.empty((3, h, w), dtype=torch.uint8) for h, w in sizes]
            out = resample.resample_images(images, plan, 224, torch.float16)
        peak = max(snap["Total"] for snap in tracker.get_tracker_snapshot("peak").values())
    assert peak - sum(image.nbytes for image in images) - out.nbytes <= 2 * resample.CHUNK_BYTES


def test_the_plan_depends_on_each_seed_alone(mixed_images) -> None:
    spec, sizes = SPECS["random resized crop and flip"], resample.sizes_of(mixed_images)
    whole = resample.plan_batch(*sizes, np.arange(8), spec)
    half = resample.plan_batch(sizes[0][4:], sizes[1][4:], np.arange(4, 8), spec)
    assert np.array_equal(whole[4:], half) and not np.array_equal(
        whole, resample.plan_batch(*sizes, np.arange(8) + 1, spec)
    )
    assert whole.shape == (8, resample.PLAN_WIDTH) and set(whole[:, -1]) == {0.0, 1.0}


def _augmented_on(bundle, augment_on: AugmentOn, items) -> object:
    return collate(GuardedSamples(bundle.train, replace=True, augment_on=augment_on).__getitems__(items))


def test_augment_on_device_ships_the_uncropped_batch_and_the_feed_crops_it(tmp_path: Path) -> None:
    """data.augment_on=device: the worker sends decoded images and plans; the feed's crops are torchvision's
    within its uint8 rounding, and the workers' within their stated bound: both places train on the same images."""
    bundle = build_shapes("shapes", 32, [0.5] * 3, [0.25] * 3, True, str(tmp_path), 40, 10, 0)
    items = [(i, 1000 + i) for i in range(8)]
    raw, crops = _augmented_on(bundle, AugmentOn.device, items), _augmented_on(bundle, AugmentOn.workers, items)
    assert isinstance(raw.images, RawBatch) and raw.images.images.dtype == torch.uint8
    assert raw.images.plan.shape == (8, resample.PLAN_WIDTH) and torch.equal(raw.labels, crops.labels)
    feed = Feed.build(
        bundle, torch.device("cpu"), torch.contiguous_format, pinned=False, prefetch=False, gpu_decode=False
    )
    on_device = feed.to_model(raw)[0] * feed.std + feed.mean  # back to 0..255 levels
    decoded = [bundle.train.decoded(i)[0] for i, _ in items]
    per_image = _per_image(decoded, np.array([seed for _, seed in items]), batched.spec_of(bundle.train.transform))
    assert (on_device - per_image).abs().max() <= 1.01  # torchvision's own kernels, image by image
    in_workers = feed.to_model(crops)[0] * feed.std + feed.mean  # roi_align at 32 px: test_batched's bound
    assert (on_device - in_workers).abs().mean() <= 0.5 and (on_device - in_workers).abs().quantile(0.99) <= 2
    again = feed.to_model(_augmented_on(bundle, AugmentOn.device, items[4:]))[0] * feed.std + feed.mean
    assert torch.equal(again, on_device[4:])  # the same sample, the same crop, whatever its batch


def test_auto_sends_only_batches_of_one_size_near_the_crop_to_the_device(tmp_path: Path) -> None:
    bundle = build_shapes("shapes", 32, [0.5] * 3, [0.25] * 3, True, str(tmp_path), 40, 10, 0)
    items = [(i, i) for i in range(4)]
    assert isinstance(_augmented_on(bundle, AugmentOn.auto, items).images, RawBatch)  # 32 px images, 32 px crops
    bundle.train.transform = train_transform(16)  # 4x the crop's pixels: the workers crop
    assert isinstance(_augmented_on(bundle, AugmentOn.auto, items).images, torch.Tensor)
    assert isinstance(_augmented_on(bundle, AugmentOn.device, items).images, RawBatch)


def test_the_loader_plan_keeps_auto_in_the_workers_off_cuda() -> None:
    from imgtrain.config.data import DataConfig
    from imgtrain.data.loader import plan_loader

    cpu = plan_loader(DataConfig(num_workers=0), train=True, device_type="cpu")
    cuda = plan_loader(DataConfig(num_workers=0), train=True, device_type="cuda")
    assert cpu.augment_on == AugmentOn.workers and cuda.augment_on == AugmentOn.auto
    assert cpu.describe()["augment_on"] == "workers"
    asked = plan_loader(DataConfig(num_workers=0, augment_on=AugmentOn.device), train=True, device_type="cpu")
    assert asked.augment_on == AugmentOn.device


CIFAR_TRAIN = v2.Compose([v2.RandomCrop(32, padding=4), v2.RandomHorizontalFlip()])


@pytest.mark.parametrize(
    ("transform", "pad", "size"),  # pad None: no random crop; size None: not batched (each sample on its own)
    [
        (None, None, 32),
        (square_resize(48), None, 48),
        (CIFAR_TRAIN, 4, 32),
        (v2.Compose([*CIFAR_TRAIN.transforms, square_resize(64)]), 4, 64),
        (v2.Compose([v2.RandomCrop(32, padding=4, padding_mode="reflect"), v2.RandomHorizontalFlip()]), None, None),
        (v2.RandomCrop(32, padding=4), None, None),
        (v2.ColorJitter(0.5), None, None),
    ],
)
def test_in_memory_datasets_transform_whole_batches(transform, pad, size) -> None:
    images = torch.randint(0, 256, (20, 3, 32, 32), generator=torch.Generator().manual_seed(0), dtype=torch.uint8)
    dataset = TensorImageDataset(images, np.arange(20) % 10, [str(i) for i in range(10)], transform)
    assert dataset.batchable is (size is not None)
    samples = GuardedSamples(dataset)
    items = [(i, 500 + 3 * i) for i in range(0, 20, 2)]
    batch = collate(samples.__getitems__(items))
    assert batch.labels.tolist() == [i % 10 for i in range(0, 20, 2)]
    if size is None:
        return
    expected = images[torch.arange(0, 20, 2)]
    if pad is not None:
        expected = batched.pad_crop_flip(expected, torch.tensor([seed for _, seed in items]), pad)
    if size != 32:
        expected = F.resize(expected, [size, size], antialias=True)
    assert torch.equal(batch.images, expected)
    assert torch.equal(collate(samples.__getitems__(items[3:])).images, batch.images[3:])  # each sample's own seed
    assert batch.times.samples == 10 and batch.times.augment > 0


@pytest.mark.slow  # slow: the fast suite's budget (make test <= 120 s on 2 cores); CI runs it in make test-slow
def test_a_run_augmenting_on_the_device_trains_and_reruns_bit_identically(tmp_path: Path, data_dir: Path) -> None:
    """The whole loop with data.augment_on=device (the training process crops, as a GPU would): it trains, says
    where it augments, and a deterministic rerun gives the same losses to the bit."""
    args = ["debug=fast", "data.augment_on=device", "data.num_workers=0", "system.deterministic=true"]
    values, names = [], ("first", "again")
    for name in names:
        run(compose_cfg(*args, "train.max_steps=4", output_dir=str(tmp_path / name)))
        values.append(json.loads((tmp_path / name / "metrics.json").read_text()))
    first, again = values
    assert first["steps"] == 4 and first["loader"]["augment_on"] == "device"
    assert (first["val_loss"], first["val_acc"]) == (again["val_loss"], again["val_acc"])
    weights = [torch.load(tmp_path / name / "checkpoints" / "last.pt", weights_only=False)["model"] for name in names]
    assert all(torch.equal(weights[0][key], weights[1][key]) for key in weights[0])
