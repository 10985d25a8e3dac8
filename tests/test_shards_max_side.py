"""`imgtrain-shards --max-side N`: images whose longer side is above N stored downscaled to N, upright, as JPEGs;
the others as their bytes; both splits, folder and CSV sources; recorded in the manifest, said by the converter and
in the run's log; a destination packed with another --max-side is packed again, not kept."""

from __future__ import annotations

import io
import json
import logging
import signal
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image, ImageOps
from shardhelpers import pack

pytest.importorskip("litdata", reason="dataset=shards needs the shards extra: pip install -e '.[shards]'")

from imgtrain.data.datasets import train_transform  # noqa: E402
from imgtrain.data.samples import Uncropped  # noqa: E402
from imgtrain.data.shards import convert as converter  # noqa: E402
from imgtrain.data.shards.dataset import Record, ShardSplit, build_shards  # noqa: E402
from imgtrain.data.shards.downscale import QUALITY, MaxSide, target_size  # noqa: E402
from imgtrain.data.shards.manifest import MANIFEST, PARTIAL, Manifest  # noqa: E402
from imgtrain.data.shards.store import Location  # noqa: E402

ORIENTATION = 0x0112  # EXIF's tag


def quadrants(width: int, height: int, alpha: bool = False) -> Image.Image:
    """Four flat colours, one per quadrant (red, green / blue, yellow), so a turn or a mirror shows."""
    pixels = np.zeros((height, width, 4 if alpha else 3), np.uint8)
    top, left = slice(0, height // 2), slice(0, width // 2)
    bottom, right = slice(height // 2, None), slice(width // 2, None)
    for rows, cols, colour in ((top, left, 0), (top, right, 1), (bottom, left, 2), (bottom, right, (0, 1))):
        pixels[rows, cols, colour] = 255
    if alpha:
        pixels[..., 3] = 128
    return Image.fromarray(pixels)


def jpeg(image: Image.Image, orientation: int = 1) -> bytes:
    exif = Image.Exif()
    if orientation != 1:
        exif[ORIENTATION] = orientation
    out = io.BytesIO()
    image.save(out, "JPEG", quality=95, exif=exif.tobytes())
    return out.getvalue()


@pytest.fixture
def photos(tmp_path: Path) -> Path:
    """Both splits: images above 128 px (a JPEG, one stored turned with EXIF orientation 6, a PNG with alpha), some
    at most 128 px, and a damaged JPEG."""
    src = tmp_path / "photos"
    files = {
        "train/a/wide.jpg": jpeg(quadrants(300, 200)),
        "train/a/small.jpg": jpeg(quadrants(80, 60)),
        "train/a/edge.jpg": jpeg(quadrants(128, 40)),  # exactly N: kept
        "train/b/turned.jpg": jpeg(quadrants(300, 200), orientation=6),  # shown 200 wide, 300 high
        "train/b/cut.jpg": jpeg(quadrants(300, 200))[:200],
        "val/a/tall.jpg": jpeg(quadrants(160, 240)),
        "val/b/small.jpg": jpeg(quadrants(100, 50)),
    }
    for name, data in files.items():
        (src / name).parent.mkdir(parents=True, exist_ok=True)
        (src / name).write_bytes(data)
    quadrants(200, 150, alpha=True).save(src / "train/b/alpha.png")
    return src


def stored(root: Path, split: str) -> dict[str, bytes]:
    """path -> stored image bytes of a split, by LitData's random access."""
    samples = json.loads((root / MANIFEST).read_text())["splits"][split]["samples"]
    cache = {"dir": None, "limit": None, "timeout_s": 5.0}
    dataset = ShardSplit(Location.parse(str(root)), split, None, gpu_decode=False, cache=cache, samples=samples)
    return {record["path"]: bytes(record["image"]) for record in (dataset[i] for i in range(len(dataset)))}


def pixels(data: bytes) -> np.ndarray:
    return np.asarray(Image.open(io.BytesIO(data)).convert("RGB"), np.int32)


def test_images_above_max_side_are_stored_downscaled_and_upright_the_others_as_their_bytes(
    photos: Path, tmp_path: Path, capsys
) -> None:
    """The PNG above N is stored as a JPEG too (RGB: its alpha dropped), as every downscaled image is."""
    assert pack(photos, tmp_path / "out", "--max-side", "128") == 0
    out = capsys.readouterr().out
    assert "unreadable, left out: train/b/cut.jpg" in out  # damaged: left out as without --max-side
    assert "packed at --max-side 128 (4 of 7 images downscaled, JPEG quality 90)" in out
    train, val = stored(tmp_path / "out", "train"), stored(tmp_path / "out", "val")
    for name in ("train/a/small.jpg", "train/a/edge.jpg", "val/b/small.jpg"):
        assert (train | val)[name] == (photos / name).read_bytes()  # at most N: byte for byte
    sizes = {name: Image.open(io.BytesIO(data)).size for name, data in (train | val).items()}
    assert (sizes["train/a/wide.jpg"], sizes["val/a/tall.jpg"], sizes["train/b/alpha.png"]) == (
        (128, 85),  # 200 x 128 / 300 = 85.3: the aspect kept, rounded
        (85, 128),
        (128, 96),
    )
    for name in ("train/a/wide.jpg", "train/b/turned.jpg", "train/b/alpha.png", "val/a/tall.jpg"):
        image = Image.open(io.BytesIO((train | val)[name]))
        assert (image.format, image.mode, image.getexif().get(ORIENTATION)) == ("JPEG", "RGB", None)
    turned = Image.open(photos / "train/b/turned.jpg")
    assert sizes["train/b/turned.jpg"] == (85, 128)  # upright: its width and height swapped
    expected = ImageOps.exif_transpose(turned).convert("RGB").resize((85, 128), Image.Resampling.LANCZOS)
    difference = np.abs(pixels(train["train/b/turned.jpg"]) - np.asarray(expected, np.int32))
    assert difference.mean() < 3, difference.mean()  # JPEG's error; turned the wrong way, most pixels would differ
    manifest = json.loads((tmp_path / "out" / MANIFEST).read_text())
    assert (manifest["max_side"], manifest["max_side_quality"]) == (128, QUALITY)
    assert {split: manifest["splits"][split]["downscaled"] for split in ("train", "val")} == {"train": 3, "val": 1}


def test_a_csv_source_is_downscaled_too(photos: Path, tmp_path: Path) -> None:
    lists = tmp_path / "lists"
    lists.mkdir()
    for split, names in (("train", ["a/wide.jpg", "a/small.jpg", "b/turned.jpg"]), ("val", ["a/tall.jpg"])):
        rows = [f"../photos/{split}/{name},{name.split('/')[0]}" for name in names]
        (lists / f"{split}.csv").write_text("path,label\n" + "\n".join(rows) + "\n")
    assert pack(lists / "train.csv", tmp_path / "out", "--val", str(lists / "val.csv"), "--max-side", "128") == 0
    train, val = stored(tmp_path / "out", "train"), stored(tmp_path / "out", "val")
    assert train["../photos/train/a/small.jpg"] == (photos / "train/a/small.jpg").read_bytes()
    assert Image.open(io.BytesIO(train["../photos/train/b/turned.jpg"])).size == (85, 128)
    assert Image.open(io.BytesIO(val["../photos/val/a/tall.jpg"])).size == (85, 128)
    splits = json.loads((tmp_path / "out" / MANIFEST).read_text())["splits"]
    assert (splits["train"]["downscaled"], splits["val"]["downscaled"]) == (2, 1)


def test_another_max_side_packs_the_destination_again(photos: Path, tmp_path: Path, capsys) -> None:
    dst = tmp_path / "out"
    assert pack(photos, dst, "--max-side", "128") == 0
    assert pack(photos, dst, "--max-side", "128") == 0
    assert "already holds this dataset" in capsys.readouterr().out  # the same settings: nothing to do
    assert pack(photos, dst, "--max-side", "64", "--max-side-quality", "80") == 0
    out = capsys.readouterr().out
    assert "packed at --max-side 128 (JPEG quality 90); this run packs it at --max-side 64 (JPEG quality 80)" in out
    assert Image.open(io.BytesIO(stored(dst, "train")["train/a/wide.jpg"])).size == (64, 43)
    assert Image.open(io.BytesIO(stored(dst, "val")["val/a/tall.jpg"])).size == (43, 64)
    manifest = json.loads((dst / MANIFEST).read_text())
    assert (manifest["max_side"], manifest["max_side_quality"], manifest["splits"]["val"]["downscaled"]) == (64, 80, 2)
    assert pack(photos, dst) == 0  # no --max-side: every image as its bytes again
    assert "this run packs it as the source files' bytes (no --max-side)" in capsys.readouterr().out
    assert stored(dst, "train")["train/a/wide.jpg"] == (photos / "train/a/wide.jpg").read_bytes()
    manifest = json.loads((dst / MANIFEST).read_text())
    assert (manifest["max_side"], manifest["max_side_quality"], manifest["splits"]["val"]["downscaled"]) == (
        None,
        None,
        0,
    )
    assert not (dst / PARTIAL).exists()


def test_an_unfinished_conversion_packed_otherwise_is_not_resumed(
    photos: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys
) -> None:
    dst, real = tmp_path / "out", converter.pack_split

    def stopped_in_val(source, store, split, *args):
        if split == "val":
            raise KeyboardInterrupt
        return real(source, store, split, *args)

    monkeypatch.setattr(converter, "pack_split", stopped_in_val)
    assert pack(photos, dst, "--max-side", "128") == 130  # train finished at 128, val not
    monkeypatch.setattr(converter, "pack_split", real)
    capsys.readouterr()
    assert pack(photos, dst, "--max-side", "64") == 0
    assert "packed at --max-side 128 (JPEG quality 90); this one packs at --max-side 64" in capsys.readouterr().out
    assert Image.open(io.BytesIO(stored(dst, "train")["train/a/wide.jpg"])).size == (64, 43)  # train packed again


@pytest.mark.parametrize(
    ("flags", "line"),
    [
        (["--max-side", "0"], "argument --max-side: '0': expected a whole number >= 1 (pixels)"),
        (["--max-side", "big"], "argument --max-side: 'big': expected a whole number >= 1 (pixels)"),
        (
            ["--max-side", "64", "--max-side-quality", "101"],
            "argument --max-side-quality: '101': expected a whole number from 1 to 100 (a JPEG quality)",
        ),
        (["--max-side-quality", "80"], "--max-side-quality applies only with --max-side N"),
    ],
)
def test_a_bad_max_side_is_one_line(flags: list[str], line: str, tmp_path: Path, capsys) -> None:
    with pytest.raises(SystemExit):
        pack(tmp_path, tmp_path / "out", *flags)
    err = capsys.readouterr().err
    assert line in err and len([row for row in err.splitlines() if "error:" in row]) == 1


def test_the_run_logs_how_the_shards_were_packed(photos: Path, tmp_path: Path, caplog) -> None:
    """And a manifest written before --max-side (no such keys) still loads: every image as its bytes."""
    assert pack(photos, tmp_path / "out", "--max-side", "128") == 0
    settings = {"image_size": 32, "mean": (0.5,) * 3, "std": (0.5,) * 3, "augment": "none", "val_resize": None}
    with caplog.at_level(logging.INFO, logger="imgtrain.data.shards.dataset"):
        build_shards("shards", root=str(tmp_path / "out"), decode="cpu", cache_dir=str(tmp_path), **settings,
                     cache_limit_gb=None, timeout_s=5.0)  # fmt: skip
    assert "packed at --max-side 128 (4 of 7 images downscaled, JPEG quality 90)" in caplog.text
    old = json.loads((tmp_path / "out" / MANIFEST).read_text())
    for key in ("max_side", "max_side_quality"):
        del old[key]
    for split in old["splits"].values():
        del split["downscaled"]
    manifest = Manifest.from_json(json.dumps(old), "old")
    assert (manifest.max_side, manifest.splits["train"].downscaled) == (None, 0)
    assert manifest.packed() == "packed as the source files' bytes (no --max-side)"


def test_deep_images_are_scaled_not_clipped_and_sizes_round() -> None:
    """A 16-bit gray PNG is scaled to 8 bits as training's decoder scales it: a mid-grey stays mid-grey."""
    out = io.BytesIO()
    Image.fromarray(np.full((150, 300), 32768, np.uint16)).save(out, "PNG")
    small = pixels(MaxSide(100).shrunk(out.getvalue()))
    assert small.shape == (50, 100, 3) and abs(small.mean() - 128) < 2
    assert MaxSide(100).shrunk(jpeg(quadrants(100, 20))) is None  # at most N: stored as it is
    big = jpeg(quadrants(1200, 800), orientation=8)  # decoded at 1/4 scale (still twice the target), then Lanczos
    expected = ImageOps.exif_transpose(Image.open(io.BytesIO(big))).resize((85, 128), Image.Resampling.LANCZOS)
    difference = np.abs(pixels(MaxSide(128).shrunk(big)) - np.asarray(expected, np.int32))
    assert difference.shape == (128, 85, 3) and difference.mean() < 3, difference.mean()
    assert (target_size(300, 200, 128), target_size(1000, 1, 10), target_size(7, 7, 3)) == ((128, 85), (10, 1), (3, 3))


def test_shards_decode_a_photo_at_reduced_scale_for_its_crop(photos: Path, tmp_path: Path) -> None:
    """dataset.scaled_decode on shards: a stored 300x200 JPEG is decoded at a reduced scale for a 32-px crop and left
    Uncropped with its sample's seed and its full upright size (the batch's crop is drawn on that); off, in full."""
    assert pack(photos, tmp_path / "out") == 0
    record = Record(jpeg(quadrants(300, 200), orientation=6), 0, "turned.jpg")
    cache = {"dir": None, "limit": None, "timeout_s": 5.0}
    for scaled, full in ((True, (300, 200)), (False, None)):
        split = ShardSplit(
            Location.parse(str(tmp_path / "out")), "train", train_transform(32), gpu_decode=False, cache=cache,
            samples=5, scaled=scaled,
        )  # fmt: skip
        uncropped, *_ = split._decode(record, 7)
        assert isinstance(uncropped, Uncropped) and uncropped.seed == 7 and uncropped.full == full, uncropped
        height, width = uncropped.image.shape[1:]
        assert height * 2 == width * 3  # upright: 200 wide, 300 high at any scale
        assert (height < 300) == scaled  # 1/2 to 1/8 for the box this seed draws; in full without it


def test_the_converter_packs_after_this_process_ran_parallel_kernels(photos: Path, tmp_path: Path) -> None:
    """LitData forks the converter's workers. A parent that had run a multi-threaded kernel left the children a
    thread pool they could not use: their first decode waited forever. Each worker now runs on one thread. (An
    alarm fails this test after 2 minutes instead of stalling the suite.)"""
    image = torch.randint(0, 256, (1, 3, 1200, 1600), dtype=torch.uint8)
    torch.nn.functional.avg_pool2d(image.float(), 8)  # a parallel kernel in this process, before the fork

    def too_long(signum: int, frame: object) -> None:
        raise TimeoutError("the conversion did not finish in 120 s")

    previous = signal.signal(signal.SIGALRM, too_long)
    signal.alarm(120)
    try:
        assert pack(photos, tmp_path / "out") == 0
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
