"""dataset.gpu_decoder=nvimgcodec (data/region_decode.py), on the CPU: nvImageCodec's libjpeg-turbo backend runs the
same batched code the GPU backends run, so the region mapping, EXIF orientation, the files the hardware engine
refuses, unreadable files, the size limit and the region check are tested here; tests/test_gpu_decode_cuda.py
repeats the comparisons on a GPU."""

from __future__ import annotations

import io
import logging
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import compose_cfg
from PIL import Image

from imgtrain.config.datasets import GpuDecoder
from imgtrain.config.fields import AugmentOn
from imgtrain.config.validate import validate
from imgtrain.data import codec_engine, region_probe, resample
from imgtrain.data.datasets import EncodedFileDataset, eval_transform, imagenet_transforms, train_transform
from imgtrain.data.decoders import upright
from imgtrain.data.gpu_decode import JpegBatchDecoder
from imgtrain.data.image_files import ImageFileDataset
from imgtrain.data.jpeg import EncodedBatch
from imgtrain.data.pipeline import decodes_on_gpu
from imgtrain.data.region_decode import RegionBatchDecoder, batch_decoder, stored_regions
from imgtrain.data.samples import GuardedSamples, collate
from imgtrain.host.optional import MissingEngine
from imgtrain.metrics import preflight

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from photos import render  # noqa: E402  benchmarks/photos.py: photo-like content at quality 90

try:
    region_probe.import_codec()
except MissingEngine as missing:
    pytest.skip(str(missing), allow_module_level=True)
CPU = torch.device("cpu")
SIZE = 64
# (stored width, height, EXIF orientation, what PIL writes): the hardware engine's own kind, the kinds it refuses
# (progressive; 4:1:1, written by simplejpeg) and the other layouts, several turned by EXIF
KINDS = {
    "baseline": (640, 480, 1, {}),
    "progressive": (480, 640, 1, {"progressive": True}),
    "4:2:2 turned 6": (600, 400, 6, {"subsampling": "4:2:2"}),
    "4:4:4 turned 3": (500, 375, 3, {"subsampling": "4:4:4"}),
    "grayscale turned 8": (400, 300, 8, {"mode": "L"}),
    "restart markers turned 5": (333, 250, 5, {"restart_marker_blocks": 3}),
    "mirrored 2": (300, 400, 2, {}),
    "turned 7": (420, 300, 7, {}),
    "flipped 4": (350, 260, 4, {}),
}


def write_jpeg(path: Path, width: int, height: int, orientation: int, options: dict, seed: int) -> None:
    image = Image.open(io.BytesIO(render(width, height, np.random.default_rng(seed))))
    image = image.convert(options.pop("mode", "RGB"))
    exif = Image.Exif()
    if orientation != 1:
        exif[0x0112] = orientation
    image.save(path, "JPEG", quality=90, exif=exif, **options)


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    root = tmp_path_factory.mktemp("kinds")
    paths = []
    for seed, (name, (width, height, orientation, options)) in enumerate(KINDS.items()):
        write_jpeg(path := root / f"{name}.jpg", width, height, orientation, dict(options), seed)
        paths.append(str(path))
    simplejpeg = pytest.importorskip("simplejpeg")
    pixels = np.asarray(Image.open(io.BytesIO(render(560, 420, np.random.default_rng(99)))).convert("RGB"))
    (path := root / "4-1-1.jpg").write_bytes(simplejpeg.encode_jpeg(pixels, 90, "RGB", "411"))
    return [*paths, str(path)]


def encoded(paths: list[str], items: list, max_pixels: int | None = None) -> object:
    dataset = EncodedFileDataset(paths, list(range(len(paths))), [str(i) for i in range(len(paths))], None, max_pixels)
    return collate(GuardedSamples(dataset, replace=False).__getitems__(items))


@pytest.mark.parametrize("orientation", range(1, 9))
def test_a_box_in_the_upright_image_is_the_same_pixels_in_the_stored_one(orientation: int) -> None:
    stored = torch.arange(3 * 30 * 44).view(3, 30, 44)
    shown = upright(stored, orientation)
    rng = np.random.default_rng(orientation)
    for _ in range(20):
        top, left = rng.integers(0, shown.shape[1] - 1), rng.integers(0, shown.shape[2] - 1)
        bottom, right = rng.integers(top + 1, shown.shape[1] + 1), rng.integers(left + 1, shown.shape[2] + 1)
        t, b, l_, r = stored_regions(
            np.array([[top, bottom, left, right]]), np.array([orientation]), np.array([[30, 44]])
        )[0]
        assert torch.equal(upright(stored[:, t:b, l_:r], orientation), shown[:, top:bottom, left:right])


@pytest.mark.parametrize("split", ["train", "val"])
def test_regions_decode_to_the_full_decodes_crops_on_every_kind(files: list[str], split: str) -> None:
    """Each kind, EXIF turns included: the crops of torchvision's full decode (JpegBatchDecoder, the same plan) to
    float32 rounding, and the CPU workers' within their uint8 resize's rounding (1 level), edges included."""
    train = split == "train"
    transform = train_transform(SIZE) if train else eval_transform(SIZE)
    items = [(i % len(files), 500 + i) for i in range(2 * len(files))] if train else list(range(len(files)))
    batch = encoded(files, items)
    ours = RegionBatchDecoder(transform, drop=not train)(batch, CPU)
    full = JpegBatchDecoder(transform, drop=not train)(batch, CPU)
    assert ours.images.shape == (len(items), 3, SIZE, SIZE) and not ours.skipped
    assert (ours.images - full.images).abs().max() <= 1e-3
    workers = ImageFileDataset(files, list(range(len(files))), [str(i) for i in range(len(files))], transform)
    cpu = collate(GuardedSamples(workers).__getitems__(items)).images.float()  # scaled decoding off
    difference = (ours.images - cpu).abs()
    edges = [difference[..., 0, :], difference[..., -1, :], difference[..., 0], difference[..., -1]]
    assert difference.max() <= 1.01 and max(edge.max() for edge in edges) <= 1.01


def test_any_other_transform_gets_whole_upright_images(files: list[str]) -> None:
    """A transform the batched crop does not describe: each whole image, upright, through it, as torchvision's."""
    batch = encoded(files, list(range(len(files))))
    corner = lambda image: image[:, :8, :8]  # noqa: E731
    ours = RegionBatchDecoder(corner)(batch, CPU).images
    assert ours.dtype == torch.uint8 and torch.equal(ours, JpegBatchDecoder(corner)(batch, CPU).images)


def test_only_each_crops_window_is_decoded(files: list[str]) -> None:
    """The decoded regions are the plans' windows (as stored), not whole images: half the pixels here (boxes of 35%
    to 100% of each image, some cut to their aspect ratio)."""
    transform = train_transform(SIZE)
    batch = encoded(files, [(i, 7 * i) for i in range(len(files))])
    decoder = RegionBatchDecoder(transform)
    decoder(batch, CPU)
    streams = decoder.engine.streams(batch.images.files())
    stored = np.array([(s.height, s.width) for s in streams])
    orientations = batch.images.orientations.numpy()
    sizes = np.where((orientations >= 5)[:, None], stored[:, ::-1], stored)
    plan = resample.plan_batch(sizes[:, 0], sizes[:, 1], batch.images.seeds.numpy(), decoder.spec)
    bounds, _ = resample.plan_in_windows(plan, SIZE)
    regions = stored_regions(bounds, orientations, stored)
    decoded = decoder._decoded(batch.images.files(), streams, regions, whole=False)
    assert [tuple(d.shape[1:]) for d in decoded] == [(b - t, r - l_) for t, b, l_, r in regions]
    assert sum(d[0].numel() for d in decoded) < 0.6 * stored.prod(1).sum()  # measured: 0.50


def test_with_scaled_decoding_the_workers_crop_within_the_scaled_tolerance(tmp_path: Path) -> None:
    """Against the CPU workers with dataset.scaled_decode on (1/2 to 1/8 scale, boxes moved by half a pixel at
    most): within tests/test_scaled_decode.py's bound, 6 levels on average per image."""
    paths = []
    for i, (width, height) in enumerate(((1200, 900), (900, 1200), (1203, 901))):
        write_jpeg(path := tmp_path / f"{i}.jpg", width, height, 1, {}, i)
        paths.append(str(path))
    transform = imagenet_transforms(96, mean=(0.5, 0.5, 0.5))[0]
    items = [(i % 3, 1000 + i) for i in range(12)]
    ours = RegionBatchDecoder(transform)(encoded(paths, items), CPU).images
    workers = ImageFileDataset(paths, [0, 1, 2], list("abc"), transform, scaled=True)
    samples = GuardedSamples(workers, augment_on=AugmentOn.workers).__getitems__(items)
    assert all(sample[0].full is not None for sample in samples)  # each decoded at reduced scale
    difference = (ours - collate(samples).images.float()).abs().mean(dim=(1, 2, 3))
    assert difference.max() < 6.0, difference


def test_unreadable_and_oversized_files_are_counted_as_on_every_path(files: list[str], tmp_path: Path) -> None:
    """A file every decoder refuses (its frame names a quantization table it never defines; the markers the workers
    check read): replaced (training) or left out (validation), counted; one above dataset.max_image_pixels: refused
    by the workers' header check, never decoded."""
    data = bytearray(Path(files[0]).read_bytes())
    frame = data.find(b"\xff\xc0")  # baseline SOF: length, precision, height, width, then 3 bytes a component
    for component in range(data[frame + 9]):
        data[frame + 12 + 3 * component] = 3  # its quantization table: 3, never defined
    (garbage := tmp_path / "garbage.jpg").write_bytes(bytes(data))
    paths = [files[0], str(garbage), files[1]]
    batch = encoded(paths, [(0, 1), (1, 2), (2, 3)])
    assert not batch.skipped  # the workers pass it: its markers read
    training = RegionBatchDecoder(train_transform(SIZE))(batch, CPU)
    assert [p for p, _ in training.skipped] == [str(garbage)] and training.images.shape[0] == 3
    assert training.labels.tolist() == [0, 2, 2] and torch.equal(training.images[1], training.images[2])
    validation = RegionBatchDecoder(eval_transform(SIZE), drop=True)(batch, CPU)
    assert validation.labels.tolist() == [0, 2] and validation.sources == (files[0], files[1])
    limited = encoded([files[0], files[1]], [0, 1], max_pixels=300_000)  # 640x480 is above, 480x640 too
    assert limited.images is None and all("max_image_pixels=300000" in why for _, why in limited.skipped)


def test_a_region_that_differs_from_the_full_decode_turns_region_decoding_off(files, monkeypatch, caplog) -> None:
    """A backend whose regions are off by a pixel (what nvImageCodec#55's GPUs might give instead of an error):
    the first batch's comparison finds it, says so in one line, and the batch is the full decodes' crops."""
    monkeypatch.setattr(codec_engine, "_REGIONS", {})
    real = codec_engine.CodecDecoder.decode

    def shifted(self, streams, regions=None):
        return real(self, streams, None if regions is None else regions + np.array([1, 1, 0, 0]))

    monkeypatch.setattr(codec_engine.CodecDecoder, "decode", shifted)
    batch = encoded(files[:3], [(i, i) for i in range(3)])
    with caplog.at_level(logging.WARNING):
        ours = RegionBatchDecoder(train_transform(SIZE))(batch, CPU)
    assert (ours.images - JpegBatchDecoder(train_transform(SIZE))(batch, CPU).images).abs().max() <= 1e-3
    assert codec_engine._REGIONS == {("cpu", region_probe.CPU_BACKENDS): False}
    (line,) = [r.getMessage() for r in caplog.records if "region decoding off" in r.getMessage()]
    assert "the first batch's regions differ by up to" in line


def test_a_probe_that_cannot_run_is_one_line_and_no_regions() -> None:
    """The GPU's probe in its child process, here without a GPU: the child fails, the answer is a line."""
    found = region_probe.probe_in_child(0, region_probe.GPU_BACKENDS)
    assert not found["matched"] and found["error"].startswith("the probe exit status 1: RuntimeError")
    assert "\n" not in found["error"]
    assert region_probe.probe_here(None, region_probe.CPU_BACKENDS) == {
        "matched": True,
        "max_difference": 0.0,
        "failed": [],
        "error": None,
    }


def test_the_key_chooses_the_decoder_and_a_missing_extra_is_one_line(tmp_path: Path, monkeypatch) -> None:
    assert isinstance(batch_decoder(GpuDecoder.nvimgcodec, train_transform(SIZE), False), RegionBatchDecoder)
    assert isinstance(batch_decoder(GpuDecoder.torchvision, train_transform(SIZE), False), JpegBatchDecoder)
    args = ["dataset=imagefolder", f"dataset.root={tmp_path}", "dataset.decode=cuda", "dataset.gpu_decoder=nvimgcodec"]
    cfg = validate(compose_cfg(*args))
    assert cfg.dataset.gpu_decoder == GpuDecoder.nvimgcodec
    assert preflight._decoder_in_use(cfg, None).startswith("nvImageCodec 0.9")  # metrics.json's decoder in use
    monkeypatch.setitem(sys.modules, "nvidia.nvimgcodec", None)  # as where the extra is not installed
    with pytest.raises(MissingEngine) as error:
        decodes_on_gpu(cfg, torch.device("cuda", 0))
    assert str(error.value).startswith("dataset.gpu_decoder=nvimgcodec needs nvidia-nvimgcodec-cu13")
    assert "pip install -e '.[gpu-decode]'" in str(error.value)


def test_a_batch_packed_without_orientations_is_taken_as_stored(files: list[str]) -> None:
    """EncodedBatch.pack drops the orientations when every file is upright as stored."""
    data = [torch.frombuffer(bytearray(Path(files[0]).read_bytes()), dtype=torch.uint8)]
    batch = collate(GuardedSamples(EncodedFileDataset(files[:1], [0], ["a"], None)).__getitems__([0]))
    assert batch.images.orientations is None
    packed = batch._replace(images=EncodedBatch.pack(data, [5]))
    assert RegionBatchDecoder(eval_transform(SIZE))(packed, CPU).images.shape == (1, 3, SIZE, SIZE)
