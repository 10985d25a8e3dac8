"""dataset=shards from a directory: the converter (bytes kept, the imagefolder split, unreadable files, refusals,
an interrupted conversion), training on shards, and damaged shards. Object storage: test_shards_s3.py; resume
and DDP: test_shards_resume.py (make test-slow)."""

from __future__ import annotations

import gc
import json
import os
import shutil
import socket
import tempfile
import time
from pathlib import Path

import psutil
import pytest
import torch
from helpers import compose_cfg, read_metrics
from imagefiles import lying_jpeg
from shardhelpers import failure, pack, shards_args
from test_reads import unblocked

pytest.importorskip("litdata", reason="dataset=shards needs the shards extra: pip install -e '.[shards]'")

from imgtrain.common.errors import ConfigError  # noqa: E402
from imgtrain.config.data import DataConfig  # noqa: E402
from imgtrain.config.fields import AugmentOn  # noqa: E402
from imgtrain.data.datasets import eval_transform  # noqa: E402
from imgtrain.data.folders import folder_splits  # noqa: E402
from imgtrain.data.loader import plan_loader  # noqa: E402
from imgtrain.data.pipeline import build_loader  # noqa: E402
from imgtrain.data.samples import RawBatch  # noqa: E402
from imgtrain.data.shapes import ensure_shapes  # noqa: E402
from imgtrain.data.shards import convert as converter  # noqa: E402
from imgtrain.data.shards import dataset as shards_dataset  # noqa: E402
from imgtrain.data.shards import staging  # noqa: E402
from imgtrain.data.shards.dataset import ShardError, ShardSplit  # noqa: E402
from imgtrain.data.shards.manifest import MANIFEST, PARTIAL  # noqa: E402
from imgtrain.data.shards.store import Location  # noqa: E402
from imgtrain.train.run import run  # noqa: E402


def records(root: Path, split: str) -> list[dict]:
    """Every stored record of a split, by LitData's random access."""
    dataset = shard_split(root, split)
    return [dataset[i] for i in range(len(dataset))]


def shard_split(root: Path, split: str, transform=None, gpu_decode: bool = False) -> ShardSplit:
    """A split of the shards at `root` (a directory) as build_shards makes it."""
    samples = json.loads((root / MANIFEST).read_text())["splits"][split]["samples"]
    cache = {"dir": None, "limit": None, "timeout_s": 5.0}
    return ShardSplit(Location.parse(str(root)), split, transform, gpu_decode=gpu_decode, cache=cache, samples=samples)


def test_samples_are_the_source_files_bytes_split_as_imagefolder_splits_them(source: Path, tmp_path: Path) -> None:
    flat = tmp_path / "flat"  # one folder of class folders: the converter splits it by --val-fraction
    shutil.copytree(source / "train", flat)
    assert pack(flat, tmp_path / "out", "--val-fraction", "0.25", "--split-seed", "3") == 0
    (train, train_labels), (val, val_labels), classes = folder_splits(str(flat), 0.25, 3)
    manifest = json.loads((tmp_path / "out" / MANIFEST).read_text())
    assert manifest["classes"] == classes and manifest["splits"]["val"]["samples"] == len(val)
    for split, paths, labels in (("train", train, train_labels), ("val", val, val_labels)):
        stored = {r["path"]: r for r in records(tmp_path / "out", split)}
        expected = {str(Path(p).relative_to(flat)): label for p, label in zip(paths, labels, strict=True)}
        assert set(stored) == set(expected)  # the same split as dataset=imagefolder
        for path, label in expected.items():
            assert bytes(stored[path]["image"]) == (flat / path).read_bytes() and stored[path]["label"] == label
    order = [r["index"] for r in records(tmp_path / "out", "train")]
    assert order != sorted(order)  # written in a seeded random order, so chunks mix classes


def test_unreadable_source_files_are_listed_and_left_out(source: Path, tmp_path: Path, capsys) -> None:
    src = tmp_path / "src"
    shutil.copytree(source, src)
    first = sorted((src / "train" / "ring").iterdir())[0]
    first.write_bytes(first.read_bytes()[:200])  # cut short
    (src / "val" / "star" / "notes.jpg").write_bytes(b"not an image")
    assert pack(src, tmp_path / "out") == 0
    out = capsys.readouterr().out
    assert "unreadable, left out: train/ring/" in out and "val/star/notes.jpg" in out
    assert "2 unreadable source file(s) left out" in out
    manifest = json.loads((tmp_path / "out" / MANIFEST).read_text())
    assert set(manifest["unreadable"]) == {str(first.relative_to(src)), "val/star/notes.jpg"}
    assert (manifest["splits"]["train"]["samples"], manifest["splits"]["val"]["samples"]) == (255, 64)
    assert "train on it:  python train.py dataset=shards dataset.root=" in out


def test_a_destination_holding_something_else_is_refused(source: Path, shards: Path, tmp_path: Path, capsys) -> None:
    other = tmp_path / "other"
    shutil.copytree(source / "train", other)  # a different dataset
    assert pack(other, shards) == 2
    assert "already holds shards of another dataset" in capsys.readouterr().err
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "notes.txt").write_text("mine")
    assert pack(source, tmp_path / "busy") == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "is not empty and holds no imgtrain shards" in err
    assert pack(source, shards) == 0  # the same dataset again: nothing to do
    assert "already holds this dataset" in capsys.readouterr().out


def test_an_interrupted_conversion_never_looks_complete_and_resumes(
    source: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys
) -> None:
    dst, src = tmp_path / "out", tmp_path / "src"
    shutil.copytree(source, src)
    cut = sorted((src / "train" / "ring").iterdir())[0]
    cut.write_bytes(cut.read_bytes()[:200])  # an unreadable image in the split that is kept
    real = converter.pack_split

    def stopped_in_val(source, store, split, *args):
        if split == "val":
            raise KeyboardInterrupt  # Ctrl-C while the second split is written
        return real(source, store, split, *args)

    monkeypatch.setattr(converter, "pack_split", stopped_in_val)
    assert pack(src, dst) == 130
    assert "nothing there looks complete" in capsys.readouterr().err
    assert not (dst / MANIFEST).exists() and (dst / PARTIAL).exists()
    error = failure(*shards_args(dst), run_dir=tmp_path / "run")
    assert isinstance(error, ConfigError) and "a conversion into it did not finish" in str(error)
    written = {p: p.stat().st_mtime_ns for p in (dst / "train").iterdir()}
    monkeypatch.setattr(converter, "pack_split", real)
    assert pack(src, dst) == 0
    assert "keeping train as written" in capsys.readouterr().out
    assert {p: p.stat().st_mtime_ns for p in (dst / "train").iterdir()} == written  # kept, not rewritten
    assert not (dst / PARTIAL).exists()
    assert list(json.loads((dst / MANIFEST).read_text())["unreadable"]) == [str(cut.relative_to(src))]  # kept too


def test_training_on_shards_times_each_stage_and_validates_every_image(shards: Path, tmp_path: Path) -> None:
    run(compose_cfg(*shards_args(shards), output_dir=str(tmp_path / "run")))
    metrics = read_metrics(tmp_path / "run")
    assert metrics["steps"] == 8 and metrics["val_count"] == 64 and metrics["dataset"] == "shards"
    per_image = metrics["pipeline"]["stage_ms_per_image"]
    assert all(per_image[stage] > 0 for stage in ("read", "decode", "augment", "collate")), per_image
    assert metrics["skipped_samples"] == 0


@pytest.fixture
def damaged(shards: Path, tmp_path: Path) -> Path:
    copy = tmp_path / "shards"
    shutil.copytree(shards, copy)
    return copy


def _chunk(root: Path, split: str = "train") -> Path:
    return sorted((root / split).glob("chunk-*.bin"))[0]


def _truncate(root: Path) -> str:
    chunk = _chunk(root)
    chunk.write_bytes(chunk.read_bytes()[:-100])
    return f"{chunk.name} is {chunk.stat().st_size:,} bytes, the conversion wrote"


def _remove(root: Path) -> str:
    _chunk(root).unlink()
    return "shard file(s) missing, e.g. chunk-"


def _miscount(root: Path) -> str:
    index = root / "train" / "index.json"
    content = json.loads(index.read_text())
    content["chunks"][0]["chunk_size"] += 1
    text = json.dumps(content)
    index.write_text(text[: len(text)])
    manifest = json.loads((root / MANIFEST).read_text())  # keep its size as recorded, so only the content differs
    manifest["splits"]["train"]["files"]["index.json"] = index.stat().st_size
    (root / MANIFEST).write_text(json.dumps(manifest))
    return "index.json does not match the shards it indexes"


@pytest.mark.parametrize("damage", [_truncate, _remove, _miscount], ids=["truncated", "missing", "index"])
def test_a_damaged_shard_stops_the_run_in_one_line_before_any_step(damage, damaged: Path, tmp_path: Path) -> None:
    expected = damage(damaged)
    run_dir = tmp_path / "run"
    assert expected in str(failure(*shards_args(damaged), run_dir=run_dir))
    assert not (run_dir / "checkpoints").exists() and not (run_dir / "tb").exists()


@pytest.mark.slow  # slow: the fast suite's budget (make test <= 120 s on 2 cores); CI runs it in make test-slow
def test_a_corrupt_image_inside_a_shard_is_replaced_in_training_dropped_in_validation(
    damaged: Path, tmp_path: Path
) -> None:
    for split in ("train", "val"):
        chunk = _chunk(damaged, split)
        data = bytearray(chunk.read_bytes())
        start = data.find(b"\xff\xd8\xff")  # the first stored JPEG: its start-of-image marker
        data[start : start + 4] = b"XXXX"  # same size: only decoding can tell
        chunk.write_bytes(bytes(data))
    run(compose_cfg(*shards_args(damaged, "train.epochs=2"), output_dir=str(tmp_path / "run")))
    metrics = read_metrics(tmp_path / "run")
    assert metrics["steps"] == 16 and metrics["val_count"] == 63  # every training batch full; one val image less
    assert metrics["skipped_samples"] == 4  # each read counts: 2 epochs x (1 train + 1 val)
    paths = sorted(item["path"].split(":")[-1].split("/")[0] for item in metrics["unreadable_files"])
    assert paths == ["train", "val"] and metrics["unreadable_files_count"] == 2


def test_shards_refuse_device_resident_in_one_line(shards: Path, tmp_path: Path) -> None:
    error = failure(*shards_args(shards, "data.device_resident=true"), run_dir=tmp_path / "run")
    assert "dataset=shards streams it: use data.device_resident=false" in str(error)


def test_with_decode_cuda_workers_hand_over_the_stored_jpeg_bytes(shards: Path, source: Path) -> None:
    """The worker half of dataset.decode=cuda, on the CPU: each batch is the stored JPEGs, undecoded, with the
    names of the images (the GPU half is tests/test_gpu.py)."""
    split = shard_split(shards, "val", gpu_decode=True)
    plan = plan_loader(DataConfig(num_workers=0, batch_size=16), train=False, device_type="cpu")
    batches = list(build_loader(split, plan, train=False, seed=0))
    images = [image for batch in batches for image in batch.images.files()]  # one byte buffer per batch
    names = [name for batch in batches for name in batch.sources]
    assert len(images) == len(names) == 64 and all(image.dtype == torch.uint8 for image in images)
    root, path = names[0].rsplit(":", 1)
    assert root == str(shards) and bytes(images[0].numpy()) == (source / path).read_bytes()


@pytest.mark.parametrize("workers", [0, 1])
def test_a_shard_that_breaks_during_the_run_stops_it_in_one_line(
    workers: int, damaged: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Gone after the check at start (deleted, or a network file system lost it): the line names the chunk, also
    when it comes from a worker (whose traceback is left out)."""
    monkeypatch.setattr(shards_dataset, "check_files", lambda *args: None)  # as if it broke after the check
    for chunk in (damaged / "train").glob("chunk-*.bin"):
        chunk.write_bytes(b"")
    before = {child.pid for child in psutil.Process().children()}  # e.g. a resource tracker other tests started
    error = failure(*shards_args(damaged, f"data.num_workers={workers}"), run_dir=tmp_path / "run")
    assert isinstance(error, ShardError) and f"{damaged}/train: " in str(error) and "cannot be read" in str(error)
    assert "Traceback" not in str(error) and "Caught" not in str(error), error
    started = time.monotonic()
    gc.collect()  # what the next job of a sweep does: the failed run's workers must already be gone
    left = [child for child in psutil.Process().children() if child.pid not in before]
    assert time.monotonic() - started < 2 and not left, "DataLoader workers left running"


def test_shard_batches_are_cropped_as_one_batch_in_the_workers_or_on_the_device(shards: Path) -> None:
    """Shards take the folders' batched path: `collate` crops the decoded batch at once (data.augment_on=workers),
    or sends it uncropped with its plans (device), and both give the same images within 1 level."""
    split = shard_split(shards, "val", eval_transform(24))
    batches = {}
    for place in (AugmentOn.workers, AugmentOn.device):
        data = DataConfig(num_workers=0, val_batch_size=16, augment_on=place)
        plan = plan_loader(data, train=False, device_type="cpu")
        batches[place] = list(build_loader(split, plan, train=False, seed=0))
    in_workers, on_device = batches[AugmentOn.workers], batches[AugmentOn.device]
    assert len(in_workers) == len(on_device) == 4
    for cropped, raw in zip(in_workers, on_device, strict=True):
        assert cropped.images.shape == (16, 3, 24, 24) and isinstance(raw.images, RawBatch)
        assert torch.equal(cropped.labels, raw.labels) and cropped.times.augment > 0
        assert (raw.images.resampled() - cropped.images.float()).abs().max() <= 1.01


def test_too_few_images_for_one_batch_names_the_stored_count(tmp_path: Path) -> None:
    """22 training images, batches of 64: LitData deals whole batches only, so its len() is 0; the line gives the 22
    the split holds (issue 33), not LitData's 0."""
    small = tmp_path / "small"
    assert pack(ensure_shapes(str(tmp_path / "src"), 32, 22, 6, 0), small) == 0
    line = str(failure(*shards_args(small, "data.batch_size=64"), run_dir=tmp_path / "run"))
    assert line == (
        "data.batch_size=64 is larger than the training split of 22 images, and LitData gives whole batches only "
        "with data.drop_last=true: lower it or set drop_last=false"
    )


def test_a_staging_folder_planted_by_someone_else_is_refused_not_emptied(tmp_path: Path, monkeypatch) -> None:
    """Its name is predictable: a link planted there must not make a conversion empty the link's target."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "precious").write_text("keep")
    Path(staging.folder_for("/data/shards")).symlink_to(victim)
    with pytest.raises(ConfigError, match="is not a private directory of this user"), staging.staging("/data/shards"):
        pass
    assert (victim / "precious").read_text() == "keep"


def test_the_same_bucket_path_on_two_object_stores_is_staged_apart(tmp_path: Path, monkeypatch) -> None:
    """s3://b/x on two endpoints is two datasets: converting into one never waits for, nor empties, the other's."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    with staging.staging("s3://b/x", "http://127.0.0.1:9000") as first:
        with staging.staging("s3://b/x", "http://127.0.0.1:9001") as second:
            assert first != second
        busy = pytest.raises(ConfigError, match="another imgtrain-shards is converting into it")
        with busy, staging.staging("s3://b/x", "http://127.0.0.1:9000"):
            pass


def csv_lists(source: Path, lists: Path) -> dict[str, list[Path]]:
    """train.csv and val.csv in `lists`, every 4th image of `source`'s splits (64 and 16), paths relative to them."""
    lists.mkdir()
    picked = {split: sorted((source / split).rglob("*.jpg"))[::4] for split in ("train", "val")}
    for split, paths in picked.items():
        rows = [f"{os.path.relpath(p, lists)},{p.parent.name}" for p in paths]
        (lists / f"{split}.csv").write_text("path,label\n" + "\n".join(rows) + "\n")
    return picked


def test_a_csv_source_packs_its_rows_with_their_labels(source: Path, tmp_path: Path, capsys) -> None:
    lists = tmp_path / "lists"
    picked = csv_lists(source, lists)
    assert pack(lists / "train.csv", tmp_path / "out") == 2  # a CSV needs its validation split's CSV too
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "needs the validation split's CSV too" in err and "--val <val.csv>" in err
    assert pack(lists / "train.csv", tmp_path / "out", "--val", str(lists / "val.csv")) == 0
    manifest = json.loads((tmp_path / "out" / MANIFEST).read_text())
    classes = sorted({p.parent.name for p in picked["train"]})
    assert manifest["classes"] == classes and manifest["source"]["layout"] == "CSV files"
    for split, paths in picked.items():
        stored = {(lists / r["path"]).resolve(): r for r in records(tmp_path / "out", split)}
        assert set(stored) == {p.resolve() for p in paths}  # the CSV's rows, each path as written, under its folder
        for path in paths:
            record = stored[path.resolve()]
            assert bytes(record["image"]) == path.read_bytes() and record["label"] == classes.index(path.parent.name)


@pytest.mark.slow  # a conversion and a run: 7 to 12 s on the 2-core machine
def test_shards_packed_from_a_csv_train(source: Path, tmp_path: Path) -> None:
    csv_lists(source, tmp_path / "lists")
    train, val = tmp_path / "lists" / "train.csv", tmp_path / "lists" / "val.csv"
    assert pack(train, tmp_path / "out", "--val", str(val)) == 0
    run(compose_cfg(*shards_args(tmp_path / "out"), "train.max_steps=2", output_dir=str(tmp_path / "run")))
    metrics = read_metrics(tmp_path / "run")
    assert metrics["steps"] == 2 and metrics["val_count"] == 16 and metrics["dataset"] == "shards"


def test_the_converter_leaves_out_an_image_above_max_image_pixels(source: Path, tmp_path: Path, capsys) -> None:
    """Its header read, never decoded: listed with its size, as training would find it."""
    src = tmp_path / "src"
    shutil.copytree(source, src)
    huge = sorted((src / "train" / "ring").iterdir())[0]
    huge.write_bytes(lying_jpeg(3000, 2000))  # decoded, it would be 3000x2000 of grey
    assert pack(src, tmp_path / "out", "--max-image-pixels", "1000000") == 0
    out = capsys.readouterr().out
    reason = "3000x2000 pixels (6 MP) is above dataset.max_image_pixels=1000000; not decoded"
    assert f"unreadable, left out: {huge.relative_to(src)}: {reason}" in out
    assert json.loads((tmp_path / "out" / MANIFEST).read_text())["unreadable"] == {str(huge.relative_to(src)): reason}
    with pytest.raises(SystemExit):
        pack(src, tmp_path / "other", "--max-image-pixels", "0")
    assert "argument --max-image-pixels: '0': expected pixels >= 1, or none (no limit)" in capsys.readouterr().err


@pytest.mark.parametrize("gpu_decode", [False, True])
def test_shards_check_each_image_against_max_image_pixels_before_decoding(shards: Path, gpu_decode: bool) -> None:
    """The workers of dataset=shards (and of decode=cuda on shards) refuse a stored image above the limit: the 32x32
    shapes, with a limit one pixel below them, are all dropped from validation, each named with its size."""
    split = shard_split(shards, "val", eval_transform(24), gpu_decode=gpu_decode)
    split.max_pixels = 32 * 32 - 1
    plan = plan_loader(DataConfig(num_workers=0, val_batch_size=16), train=False, device_type="cpu")
    batches = list(build_loader(split, plan, train=False, seed=0))
    reasons = {reason for batch in batches for _, reason in batch.skipped}
    assert all(batch.images is None for batch in batches) and sum(len(batch.skipped) for batch in batches) == 64
    assert reasons == {"32x32 pixels (0.00102 MP) is above dataset.max_image_pixels=1023; not decoded"}


def _small_source(source: Path, root: Path) -> Path:
    """Four images of each of two classes per split, from `source`."""
    for split in ("train", "val"):
        for name in sorted(p.name for p in (source / split).iterdir())[:2]:
            (root / split / name).mkdir(parents=True)
            for image in sorted((source / split / name).iterdir())[:4]:
                shutil.copy(image, root / split / name / image.name)
    return root


def test_a_fifo_a_device_or_a_socket_is_left_out_by_its_type(source: Path, tmp_path: Path, capsys) -> None:
    """What is not a regular file is refused before it is opened: a FIFO stalled a worker for ever (12 of 13
    files), /dev/zero under an image's name ended the split in "LitData could not write the split ()"."""
    src = _small_source(source, tmp_path / "src")
    classes = sorted(p.name for p in (src / "train").iterdir())
    os.mkfifo(fifo := src / "train" / classes[0] / "pipe.jpg")
    (src / "train" / classes[0] / "zero.jpg").symlink_to("/dev/zero")
    server = socket.socket(socket.AF_UNIX)
    server.bind(str(src / "val" / classes[1] / "socket.jpg"))
    try:
        with unblocked(fifo):
            assert pack(src, tmp_path / "out") == 0
    finally:
        server.close()
    out = capsys.readouterr().out
    for relative, kind in (
        (f"train/{classes[0]}/pipe.jpg", "a FIFO (named pipe)"),
        (f"train/{classes[0]}/zero.jpg", "a character device"),
        (f"val/{classes[1]}/socket.jpg", "a socket"),
    ):
        assert f"unreadable, left out: {relative}: {kind}, not a regular file: refused without reading it" in out
    assert "3 unreadable source file(s) left out" in out


def test_a_worker_s_unexpected_error_names_its_file(source: Path, tmp_path: Path, monkeypatch, capsys) -> None:
    """An error the converter does not expect (here a MemoryError) ends the split in one line naming the file."""
    src = _small_source(source, tmp_path / "src")
    victim = sorted((src / "train").rglob("*.jpg"))[1]
    real = converter.decode_problem

    def failing(data: bytes, path: str, *limit):  # forked into LitData's workers with the module
        if path == str(victim):
            raise MemoryError
        return real(data, path, *limit)

    monkeypatch.setattr(converter, "decode_problem", failing)
    assert pack(src, tmp_path / "out") == 1
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and f"LitData could not write the split ({victim.relative_to(src)}: MemoryError)" in err


def test_a_conversion_with_no_image_packed_for_stall_timeout_stops_naming_the_file(
    source: Path, tmp_path: Path, monkeypatch, capsys
) -> None:
    """--stall-timeout: a read hung in the storage (here a decode held for a minute) stops the conversion in one
    line naming the file the worker is on, its workers ended; before, it waited for ever."""
    src = _small_source(source, tmp_path / "src")
    victim = sorted((src / "train").rglob("*.jpg"))[2]
    real = converter.decode_problem

    def hung(data: bytes, path: str, *limit):  # forked into LitData's workers with the module
        if path == str(victim):
            time.sleep(60)
        return real(data, path, *limit)

    monkeypatch.setattr(converter, "decode_problem", hung)
    started = time.monotonic()
    assert pack(src, tmp_path / "out", "--stall-timeout", "3") == 1
    assert time.monotonic() - started < 30
    err = capsys.readouterr().err.strip()
    assert (
        "\n" not in err
        and f"no image packed in 3 s (--stall-timeout): the workers are on {victim.relative_to(src)}" in err
    )
    assert not (tmp_path / "out" / MANIFEST).exists()
