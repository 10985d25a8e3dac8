"""Tests of the dataset builders: item format, shapes generation on disk, image folders, errors, pickling."""

from __future__ import annotations

import io
import logging
import os
import pickle
import subprocess
import sys
import time
import urllib.error
import urllib.request
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from helpers import ROOT, compose_cfg
from imagefiles import lying_jpeg, png_file
from PIL import Image
from torch.utils.data import DataLoader
from torchvision.datasets import CIFAR10
from torchvision.datasets import cifar as cifar_module
from torchvision.transforms import v2

import imgtrain
from imgtrain.common.errors import ConfigError
from imgtrain.config.datasets import CifarConfig, CsvConfig, ImageFolderConfig, ShardsConfig, dataset_schemas
from imgtrain.config.validate import validate
from imgtrain.data import shapes
from imgtrain.data.cifar import build_cifar
from imgtrain.data.datasets import DatasetBundle, build_imagefolder, build_shapes, build_synthetic
from imgtrain.data.folders import split_indices
from imgtrain.data.image_files import CorruptSampleError, EncodedFileDataset, ImageFileDataset
from imgtrain.data.jpeg import JpegFrame, checked_frame

MEAN, STD = [0.5, 0.5, 0.5], [0.25, 0.25, 0.25]
SRC_DIR = str(Path(imgtrain.__file__).resolve().parents[1])


def shapes_bundle(root: Path, size: int = 32, augment: bool = True, seed: int = 0) -> DatasetBundle:
    return build_shapes("shapes", size, MEAN, STD, augment, str(root), num_train=60, num_val=20, seed=seed)


def imagefolder(root: Path | str | None, **overrides) -> DatasetBundle:
    kwargs = dict(image_size=24, augment=True, val_fraction=0.25, split_seed=0, val_resize=None)
    kwargs.update(overrides)
    return build_imagefolder(name="imagefolder", mean=MEAN, std=STD, root=None if root is None else str(root), **kwargs)


def check_items(dataset, size: int, num_classes: int, count: int = 3) -> None:
    for i in range(min(count, len(dataset))):
        image, label = dataset[i]
        assert isinstance(image, torch.Tensor) and image.dtype == torch.uint8
        assert image.shape == (3, size, size) and image.is_contiguous()
        assert type(label) is int and 0 <= label < num_classes


def files_under(directory: Path) -> list[Path]:
    return sorted(p for p in directory.rglob("*") if p.is_file())


def write_images(directory: Path, count: int, ext: str = "jpg", size: tuple[int, int] = (40, 30)) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(len(str(directory)))
    for i in range(count):
        pixels = rng.integers(0, 256, size=(size[1], size[0], 3), dtype=np.uint8)
        Image.fromarray(pixels).save(directory / f"{i}.{ext}")


# ----------------------------------------------------------------------------- shapes
def test_shapes_generates_imagefolder_layout_then_reuses_it(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="imgtrain.data.shapes")
    bundle = shapes_bundle(tmp_path)
    (base,) = [p for p in tmp_path.iterdir()]
    assert base.name == shapes.dataset_key(32, 60, 20, 0)
    assert sorted(p.name for p in base.iterdir()) == ["train", "val"]
    for split, per_class in (("train", 6), ("val", 2)):
        class_dirs = sorted(p.name for p in (base / split).iterdir())
        assert class_dirs == sorted(shapes.CLASSES)
        for name in class_dirs:
            files = list((base / split / name).iterdir())
            assert len(files) == per_class and all(f.suffix == ".jpg" for f in files)
            with Image.open(files[0]) as img:
                assert img.format == "JPEG" and img.size == (32, 32)
    assert [r.message for r in caplog.records if "generated" in r.message] != []
    assert (len(bundle.train), len(bundle.val), bundle.num_classes) == (60, 20, 10)
    assert bundle.classes == sorted(shapes.CLASSES) and bundle.mean == (0.5, 0.5, 0.5)
    check_items(bundle.train, 32, 10)
    check_items(bundle.val, 32, 10)
    assert sorted({int(x) for x in bundle.val.labels}) == list(range(10))

    caplog.clear()
    before = {p: p.stat().st_mtime_ns for p in files_under(tmp_path)}
    again = shapes_bundle(tmp_path)
    assert {p: p.stat().st_mtime_ns for p in files_under(tmp_path)} == before
    assert not [r for r in caplog.records if "generated" in r.message]
    assert list(again.train.paths) == list(bundle.train.paths)


def test_shapes_labels_match_folders_and_val_is_not_augmented(tmp_path):
    bundle = shapes_bundle(tmp_path, augment=True)
    for i, label in enumerate(bundle.val.labels):
        assert Path(bundle.val.path(i)).parent.name == bundle.classes[label]
    image, _ = bundle.val[0]
    assert torch.equal(image, bundle.val[0][0])  # deterministic
    assert not all(torch.equal(bundle.train[0][0], bundle.train[0][0]) for _ in range(5))  # random crops


def test_shapes_generation_is_deterministic(tmp_path):
    a = shapes.ensure_shapes(str(tmp_path / "a"), 32, 30, 10, seed=3)
    b = shapes.ensure_shapes(str(tmp_path / "b"), 32, 30, 10, seed=3)
    c = shapes.ensure_shapes(str(tmp_path / "c"), 32, 30, 10, seed=4)
    rel = [p.relative_to(a) for p in files_under(Path(a))]
    assert len(rel) == 40 and rel == [p.relative_to(b) for p in files_under(Path(b))]
    assert all((Path(a) / r).read_bytes() == (Path(b) / r).read_bytes() for r in rel)
    assert sum((Path(a) / r).read_bytes() != (Path(c) / r).read_bytes() for r in rel) > 30


def test_shapes_key_changes_with_the_parameters():
    keys = {shapes.dataset_key(*args) for args in [(64, 10, 5, 0), (32, 10, 5, 0), (64, 11, 5, 0), (64, 10, 6, 0)]}
    assert len(keys | {shapes.dataset_key(64, 10, 5, 1)}) == 5
    assert f"v{shapes.FORMAT_VERSION}" in shapes.dataset_key(64, 10, 5, 0)


def test_shapes_losing_the_rename_keeps_the_winners_tree(tmp_path, monkeypatch):
    key = shapes.dataset_key(32, 20, 10, 0)
    real = shapes._generate_into

    def generate_while_another_process_finishes(out_dir, *args):
        real(out_dir, *args)
        real(str(tmp_path / key), *args)  # the "other process" publishes first

    monkeypatch.setattr(shapes, "_generate_into", generate_while_another_process_finishes)
    final = shapes.ensure_shapes(str(tmp_path), 32, 20, 10, seed=0)
    assert final == str(tmp_path / key)
    assert [p.name for p in tmp_path.iterdir()] == [key]  # our temporary copy was discarded
    assert len(files_under(tmp_path)) == 30


@pytest.mark.slow  # slow: the fast suite's budget (make test <= 120 s on 2 cores); CI runs it in make test-slow
def test_shapes_concurrent_generation_from_two_processes(tmp_path):
    start = time.time() + 2.0  # both processes begin generating at the same moment
    code = (
        "import sys, time; from imgtrain.data import shapes; "
        f"time.sleep(max(0.0, {start} - time.time())); "
        f"print(shapes.ensure_shapes({str(tmp_path)!r}, 32, 300, 50, 0))"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([SRC_DIR, os.environ.get("PYTHONPATH", "")])}
    procs = [
        subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
        for _ in range(2)
    ]
    results = [p.communicate(timeout=60) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [err.decode() for _, err in results]
    paths = {out.decode().strip() for out, _ in results}
    assert paths == {str(tmp_path / shapes.dataset_key(32, 300, 50, 0))}
    assert [p.name for p in tmp_path.iterdir()] == [shapes.dataset_key(32, 300, 50, 0)]
    assert len(files_under(tmp_path)) == 350


@pytest.mark.slow  # spawn workers import torch anew
def test_shapes_dataloader_with_spawn_workers(tmp_path):
    bundle = shapes_bundle(tmp_path)
    pickle.dumps(bundle.train)
    loader = DataLoader(bundle.train, batch_size=16, num_workers=2, multiprocessing_context="spawn")
    batches = list(loader)
    assert sum(len(y) for _, y in batches) == 60
    images, labels = batches[0]
    assert images.dtype == torch.uint8 and images.shape == (16, 3, 32, 32) and labels.dtype == torch.int64


# ----------------------------------------------------------------------------- synthetic
def test_synthetic_items_and_determinism():
    build = lambda seed: build_synthetic("synthetic", 16, MEAN, STD, True, 50, 10, 7, seed)  # noqa: E731
    a, b, c = build(0), build(0), build(1)
    assert (len(a.train), len(a.val), a.num_classes, a.image_size) == (50, 10, 7, 16)
    check_items(a.train, 16, 7, count=50)
    check_items(a.val, 16, 7)
    assert torch.equal(a.train.images, b.train.images) and not torch.equal(a.train.images, c.train.images)
    assert not torch.equal(a.train.images[:10], a.val.images)


# ----------------------------------------------------------------------------- image folders
def test_imagefolder_with_train_and_val_folders(tmp_path):
    for split, count in (("train", 4), ("val", 2)):
        write_images(tmp_path / split / "cat", count)
        write_images(tmp_path / split / "dog", count, ext="png", size=(20, 50))
    write_images(tmp_path / "train" / "eel", 3, ext="bmp")  # no val images for eel: allowed
    Image.new("L", (30, 30), 128).save(tmp_path / "train" / "cat" / "gray.jpg")
    bundle = imagefolder(tmp_path)
    assert bundle.classes == ["cat", "dog", "eel"] and bundle.num_classes == 3
    assert (len(bundle.train), len(bundle.val)) == (12, 4)
    assert all(Path(bundle.val.path(i)).parts[-3] == "val" for i in range(len(bundle.val)))
    check_items(bundle.train, 24, 3, count=12)
    check_items(bundle.val, 24, 3, count=4)
    assert bundle.train.paths.dtype.kind == "S" and bundle.train.labels.dtype == np.int64  # no python objects


def test_imagefolder_split_by_fraction_is_disjoint_stratified_and_seeded(tmp_path):
    for name in ("a", "b", "c"):
        write_images(tmp_path / name, 20, size=(8, 8))
    (tmp_path / ".ipynb_checkpoints").mkdir()
    (tmp_path / "empty").mkdir()
    bundle = imagefolder(tmp_path, val_fraction=0.25, augment=False)
    assert bundle.classes == ["a", "b", "c"]
    train, val = set(bundle.train.paths.tolist()), set(bundle.val.paths.tolist())
    assert len(train) == 45 and len(val) == 15 and not train & val
    assert np.bincount(bundle.val.labels).tolist() == [5, 5, 5]
    check_items(bundle.train, 24, 3)
    same = imagefolder(tmp_path, val_fraction=0.25)
    other = imagefolder(tmp_path, val_fraction=0.25, split_seed=1)
    assert set(same.val.paths.tolist()) == val and set(other.val.paths.tolist()) != val


def test_split_indices_keeps_one_train_image_per_class():
    train, val = split_indices([0, 0, 1, 2, 2, 2, 2], val_fraction=0.5, seed=0)
    assert sorted(train.tolist() + val.tolist()) == list(range(7))
    assert 2 not in val.tolist() and len(val) == 3


@pytest.mark.parametrize("layout", ["missing", "empty", "empty_classes", "val_without_images"])
def test_imagefolder_errors_are_one_line_and_name_the_root(tmp_path, layout):
    root = tmp_path / "images"
    if layout != "missing":
        root.mkdir()
    if layout == "empty_classes":
        (root / "cat").mkdir()
        (root / "cat" / "notes.txt").write_text("not an image")
    if layout == "val_without_images":
        write_images(root / "train" / "cat", 2)
        (root / "val" / "cat").mkdir(parents=True)
    with pytest.raises(ConfigError) as info:
        imagefolder(root)  # a missing or null dataset.root is refused earlier, by validate (test_config)
    message = str(info.value)
    assert "\n" not in message and "dataset.root" in message
    assert str(root) in message


# ----------------------------------------------------------------------------- cifar
def test_cifar_offline_raises_a_config_error_that_says_where_to_put_the_files(tmp_path, monkeypatch):
    def offline(*args, **kwargs):
        raise urllib.error.URLError("[Errno -3] Temporary failure in name resolution")

    monkeypatch.setattr(urllib.request, "urlopen", offline)
    start = time.perf_counter()
    with pytest.raises(ConfigError) as info:
        build_cifar("cifar10", 32, MEAN, STD, True, str(tmp_path), download=True)
    assert time.perf_counter() - start < 10
    message = str(info.value)
    assert "\n" not in message and str(tmp_path) in message
    assert "cifar-10-python.tar.gz" in message and "download failed" in message
    with pytest.raises(ConfigError, match=r"cifar-100-python\.tar\.gz.*cifar-100-python/") as info:
        build_cifar("cifar100", 32, MEAN, STD, True, str(tmp_path), download=False)
    assert str(tmp_path) in str(info.value)
    with pytest.raises(ConfigError, match="cifar10, cifar100"):
        build_cifar("cifar7", 32, MEAN, STD, True, str(tmp_path), download=False)


def write_fake_cifar(root: Path, name: str, n: int) -> None:
    folder = root / ("cifar-10-batches-py" if name == "cifar10" else "cifar-100-python")
    folder.mkdir(parents=True)
    rng = np.random.default_rng(0)
    label_key, classes = ("labels", 10) if name == "cifar10" else ("fine_labels", 100)
    files = [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"] if name == "cifar10" else ["train", "test"]
    for file in files:
        entry = {"data": rng.integers(0, 256, (n, 3072), dtype=np.uint8), label_key: list(range(n))}
        (folder / file).write_bytes(pickle.dumps(entry))
    meta_file, meta_key = ("batches.meta", "label_names") if name == "cifar10" else ("meta", "fine_label_names")
    (folder / meta_file).write_bytes(pickle.dumps({meta_key: [f"c{i}" for i in range(classes)]}))


@pytest.mark.parametrize(("name", "size"), [("cifar10", 32), ("cifar100", 40)])
def test_cifar_items_from_local_files(tmp_path, monkeypatch, name, size):
    monkeypatch.setattr(cifar_module, "check_integrity", lambda *args, **kwargs: True)  # fakes have other md5s
    write_fake_cifar(tmp_path, name, n=8)
    bundle = build_cifar(name, size, MEAN, STD, True, str(tmp_path), download=False)
    num_classes = 10 if name == "cifar10" else 100
    train_len = 40 if name == "cifar10" else 8
    assert (len(bundle.train), len(bundle.val), bundle.num_classes) == (train_len, 8, num_classes)
    assert len(bundle.classes) == num_classes and bundle.image_size == size
    check_items(bundle.train, size, num_classes)
    check_items(bundle.val, size, num_classes)
    if size == 32:
        raw = torch.from_numpy(CIFAR10(str(tmp_path), train=False).data[3]).permute(2, 0, 1)
        assert torch.equal(bundle.val[3][0], raw) and bundle.val[3][1] == 3


def _jpeg(image: Image.Image, **save: object) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, "JPEG", **save)
    return buffer.getvalue()


def jpeg_problem(data: bytes, max_pixels: int | None = None) -> str | None:
    """Why the GPU decoder is not given `data`, None when it is."""
    checked = checked_frame(data, max_pixels)
    return None if isinstance(checked, JpegFrame) else checked


def test_jpeg_problem_reads_truncation_and_cmyk_from_the_markers() -> None:
    """What decode=cuda's workers check before handing bytes to nvJPEG, which may not report either case."""
    picture = shapes.render(3, 96, np.random.default_rng(0))
    whole = _jpeg(picture, quality=90)
    assert jpeg_problem(whole) is None
    assert jpeg_problem(_jpeg(picture, progressive=True)) is None
    assert jpeg_problem(_jpeg(picture.convert("L"))) is None  # grayscale decodes to RGB on the GPU too
    assert jpeg_problem(whole + b"\0" * 100) is None  # padding after the end-of-image marker is harmless
    assert jpeg_problem(whole[: len(whole) // 2]) == "truncated JPEG (no end-of-image marker)"
    assert "CMYK" in jpeg_problem(_jpeg(picture.convert("CMYK")))
    assert jpeg_problem(b"GIF89a....") == "not a JPEG file (dataset.decode=cuda decodes JPEG only)"
    assert jpeg_problem(whole[:40]).startswith("truncated JPEG")
    # An EXIF thumbnail carries its own end-of-image marker before the main image's data: still truncated.
    thumbnail = _jpeg(picture.resize((16, 16)))
    exif = Image.Exif()
    with_thumbnail = _jpeg(picture, exif=exif.tobytes() + thumbnail)
    assert jpeg_problem(with_thumbnail) is None
    assert jpeg_problem(with_thumbnail[: len(with_thumbnail) - 300]) == "truncated JPEG (no end-of-image marker)"


# ----------------------------------------------------------------------------- decoding on the CPU
def _picture(mode: str) -> Image.Image:
    """Gradients plus noise (what JPEG rounding shows), in PIL mode `mode`."""
    y, x = np.mgrid[0:45, 0:64]
    noise = np.random.default_rng(0).integers(0, 40, size=(45, 64, 3))
    pixels = np.stack([x * 3, y * 5, (x + y) * 2], axis=-1) + noise
    return Image.fromarray(np.clip(pixels, 0, 255).astype(np.uint8)).convert(mode)


def _one_file(path: Path) -> ImageFileDataset:
    return ImageFileDataset([str(path)], [0], ["a"], v2.Identity())


@pytest.mark.parametrize(
    ("ext", "mode"),
    [("jpg", "RGB"), ("jpg", "L"), ("jpg", "CMYK"), ("png", "RGB"), ("png", "RGBA"), ("png", "L"), ("png", "P")]
    + [("webp", "RGB"), ("bmp", "RGB"), ("tif", "RGB"), ("ppm", "RGB")],
)
def test_the_cpu_path_decodes_every_format_to_rgb_as_pillow_does_without_a_warning(tmp_path, ext, mode):
    """TorchCodec (JPEG, PNG, WebP) or PIL (the rest) through ImageFileDataset, with warnings as errors: torchvision's
    deprecated decoders warn on every call. Two libjpeg builds may differ by a level or two on the same JPEG; the
    other formats are lossless here, so they must match exactly."""
    path = tmp_path / f"image.{ext}"
    _picture(mode).save(path, **({"quality": 90} if ext == "jpg" else {"lossless": True} if ext == "webp" else {}))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        image, _ = _one_file(path)[0]
    with Image.open(path) as img:
        expected = torch.from_numpy(np.asarray(img.convert("RGB")).copy()).permute(2, 0, 1)
    assert image.dtype == torch.uint8 and image.shape == expected.shape == (3, 45, 64)
    mean_abs_diff = (image.int() - expected.int()).abs().float().mean().item()
    assert mean_abs_diff <= (2.0 if ext == "jpg" else 0.0)


@pytest.mark.parametrize("ext", ["jpg", "png", "webp"])
def test_a_truncated_image_is_a_corrupt_sample_with_a_one_line_reason(tmp_path, ext):
    whole = tmp_path / f"whole.{ext}"
    _picture("RGB").save(whole)
    cut = tmp_path / f"cut.{ext}"
    cut.write_bytes(whole.read_bytes()[: whole.stat().st_size // 2])
    with pytest.raises(CorruptSampleError) as caught:
        _one_file(cut)[0]
    assert caught.value.path == str(cut) and caught.value.reason
    assert ".cpp" not in caught.value.reason and "\n" not in caught.value.reason  # no C++ source location


# ----------------------------------------------------------------------------- an image's size, read before decoding
def _sized(path: Path, limit: int | None, cls: type = ImageFileDataset) -> ImageFileDataset:
    return cls([str(path)], [0], ["a"], v2.Identity(), max_pixels=limit)


@pytest.mark.parametrize("ext", ["jpg", "png", "webp", "gif", "tif", "bmp"])
def test_an_image_above_max_image_pixels_is_unreadable_and_named_with_its_size(tmp_path, ext):
    """TorchCodec's formats and PIL's alike: the header's size against the limit, one pixel either side."""
    path = tmp_path / f"image.{ext}"
    _picture("RGB").save(path)  # 64 x 45 = 2880 pixels
    with pytest.raises(CorruptSampleError) as caught:
        _sized(path, 2879)[0]
    assert caught.value.reason == "64x45 pixels (0.00288 MP) is above dataset.max_image_pixels=2879; not decoded"
    assert _sized(path, 2880)[0][0].shape == _sized(path, None)[0][0].shape == (3, 45, 64)


def test_a_header_is_checked_before_anything_decodes_the_file(tmp_path):
    """A JPEG whose header claims 3000x2000 over 16x16 data decodes, grey, with only a warning on stderr; a PNG
    whose header claims 5000x5000 over 4 rows fails in the decoder. Above the limit, both are refused for the size
    their header claims: nothing decoded them."""
    lying = tmp_path / "lying.jpg"
    lying.write_bytes(lying_jpeg(3000, 2000))
    assert _sized(lying, None)[0][0].shape == (3, 2000, 3000)  # what the header is believed for without a limit
    with pytest.raises(CorruptSampleError, match=r": 3000x2000 pixels \(6 MP\) is above dataset.max_image_pixels="):
        _sized(lying, 10**6)[0]
    garbage = tmp_path / "garbage.png"
    garbage.write_bytes(png_file(np.zeros((4, 8), np.uint8), claimed=(5000, 5000)))
    with pytest.raises(CorruptSampleError) as decoded:
        _sized(garbage, None)[0]
    assert "pixels" not in decoded.value.reason  # the decoder's own complaint
    with pytest.raises(CorruptSampleError, match=r": 5000x5000 pixels \(25 MP\) is above dataset.max_image_pixels="):
        _sized(garbage, 10**6)[0]


def test_pils_own_guard_follows_the_key(tmp_path, monkeypatch):
    """PIL refuses an image above twice its Image.MAX_IMAGE_PIXELS: with dataset.max_image_pixels=null (or a limit
    above PIL's) a TIFF decodes all the same; with a limit, the one line is ours. PIL's setting is left as it was."""
    path = tmp_path / "image.tif"
    _picture("RGB").save(path)
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 1000)  # as if the image were twice PIL's default
    assert _sized(path, None)[0][0].shape == _sized(path, 5000)[0][0].shape == (3, 45, 64)
    with pytest.raises(CorruptSampleError, match=r"64x45 pixels \(0.00288 MP\) is above dataset.max_image_pix"):
        _sized(path, 2000)[0]
    assert Image.MAX_IMAGE_PIXELS == 1000


def test_decode_cuda_workers_check_the_size_in_the_jpeg_markers(tmp_path):
    """dataset.decode=cuda: the workers hand nvJPEG only what its frame header allows (the same line as the CPU)."""
    lying = lying_jpeg(3000, 2000)
    assert jpeg_problem(lying) is None and jpeg_problem(lying, max_pixels=6 * 10**6) is None
    assert jpeg_problem(lying, max_pixels=10**6) == (
        "3000x2000 pixels (6 MP) is above dataset.max_image_pixels=1000000; not decoded"
    )
    path = tmp_path / "lying.jpg"
    path.write_bytes(lying)
    with pytest.raises(CorruptSampleError, match=r"lying.jpg: 3000x2000 pixels \(6 MP\) is above"):
        _sized(path, 10**6, EncodedFileDataset)[0]
    assert _sized(path, None, EncodedFileDataset)[0][0].path == str(path)


def test_max_image_pixels_is_a_key_of_every_dataset_that_reads_files(tmp_path):
    write_images(tmp_path / "a", 3)
    write_images(tmp_path / "b", 3)
    for decode, cls in (("cpu", ImageFileDataset), ("cuda", EncodedFileDataset)):
        bundle = imagefolder(tmp_path, decode=decode, max_image_pixels=1000)
        assert type(bundle.train) is cls and bundle.train.max_pixels == bundle.val.max_pixels == 1000
    assert imagefolder(tmp_path).train.max_pixels == Image.MAX_IMAGE_PIXELS == 89_478_485  # PIL's, by default
    for name in ("imagefolder", "csv", "custom dataset._target_=my.Data", "shards"):
        cfg = compose_cfg(*f"dataset={name}".split(), "dataset.max_image_pixels=0")
        with pytest.raises(ConfigError, match=r"^dataset.max_image_pixels=0 is invalid: expected null \(no limit\) or"):
            validate(cfg)


# ----------------------------------------------------------------------------- 16-bit and float images
# Every 16th 16-bit level: among them, levels where value / 257 rounded and the high byte (>> 8) differ
LEVELS = np.arange(0, 65536, 16, dtype=np.uint16).reshape(64, 64)


def to_8_bit(levels: np.ndarray) -> np.ndarray:
    """What libpng (TorchCodec) makes of 16-bit PNG levels: value / 257, rounded."""
    return ((levels.astype(np.int64) + 128) // 257).astype(np.uint8)


def _deep(tmp_path: Path, ext: str, mode: str) -> Path:
    """LEVELS as a file: 16-bit gray (I;16, I;16B), 32-bit integer (I), float 0..1 (F), or 16-bit RGB."""
    path = tmp_path / f"image.{ext}"
    if mode == "RGB;16":
        path.write_bytes(png_file(np.stack([LEVELS, LEVELS.T, LEVELS[::-1]], axis=-1)))
        return path
    arrays = {"I;16": LEVELS, "I;16B": LEVELS.astype(">u2"), "I": LEVELS.astype(np.int32)}
    image = Image.fromarray(arrays[mode] if mode in arrays else (LEVELS / 65535).astype(np.float32))
    assert image.mode == mode
    image.save(path)
    return path


@pytest.mark.parametrize(
    ("ext", "mode"), [("png", "I;16"), ("tif", "I;16"), ("tif", "I;16B"), ("tif", "I"), ("tif", "F"), ("png", "RGB;16")]
)
def test_16_bit_and_float_images_keep_their_values_on_every_path(tmp_path, ext, mode):
    """PNG through TorchCodec, TIFF through PIL (which clips I;16 to 255 when it converts to RGB): the same 8-bit
    levels, a 16-bit value v as round(v / 257), a float one as round(f * 255)."""
    image, _ = _one_file(_deep(tmp_path, ext, mode))[0]
    expected = to_8_bit(LEVELS)
    if mode == "RGB;16":
        expected = np.stack([expected, expected.T, expected[::-1]])
    elif mode == "F":
        expected = np.rint((LEVELS / 65535).astype(np.float32) * 255).astype(np.uint8)
    assert image.dtype == torch.uint8 and image.shape == (3, 64, 64)
    assert np.array_equal(image.numpy(), np.broadcast_to(expected, (3, 64, 64)))


def test_a_float_image_outside_0_to_1_is_unreadable_not_saturated(tmp_path):
    path = tmp_path / "levels.tif"
    Image.fromarray(LEVELS.astype(np.float32)).save(path)  # 0..65520 as floats: read as 0..1, it would be white
    with pytest.raises(CorruptSampleError) as caught:
        _one_file(path)[0]
    assert caught.value.reason == "float pixels from 0 to 65520, outside the 0..1 a float image is read in"


def test_a_dataset_schema_needs_no_registration() -> None:
    """dataset_schemas finds every DatasetConfig by its class name, and each conf/dataset/ file's base is one."""
    schemas = dataset_schemas()
    assert schemas["base_imagefolder"] is ImageFolderConfig and schemas["base_cifar"] is CifarConfig
    files = sorted((ROOT / "conf" / "dataset").glob("*.yaml"))
    bases = {str(item) for path in files for item in yaml.safe_load(path.read_text())["defaults"]} - {"_self_"}
    assert bases and bases <= schemas.keys(), bases - schemas.keys()


def test_a_schema_says_which_of_its_files_are_missing(tmp_path: Path) -> None:
    assert ImageFolderConfig(root=str(tmp_path)).files_problem() is None
    assert ImageFolderConfig(root=str(tmp_path / "no")).files_problem() == (
        f"dataset.root={tmp_path / 'no'} is not a directory: point it at a folder of class folders"
    )
    assert ShardsConfig(root="s3://bucket/prefix").files_problem() is None
    assert ShardsConfig().files_problem().startswith("dataset.root is required with dataset=shards: pass")
    (tmp_path / "train.csv").write_text("a.jpg,cat\n")
    assert CsvConfig(train=str(tmp_path / "train.csv")).files_problem() == (
        "dataset.val is required with dataset=csv: pass dataset.val=<a CSV or TSV of image path and label, one row "
        "per image>"
    )
