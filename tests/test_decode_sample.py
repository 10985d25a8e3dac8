"""A decode-bound verdict prescribes from the run's own files (data/decode_sample.py, metrics/report.py): their
median size, their decode time, and the speed-ups of packing them at --max-side N and of scaled decoding, as timed
on a sample of them at the end of the run (metrics/processor.py)."""

from __future__ import annotations

import io
import json
import logging
import os
import shlex
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from helpers import FAST, compose_cfg
from PIL import Image
from test_reads import unblocked
from torch.utils.data import TensorDataset

from imgtrain.config.validate import validate
from imgtrain.data import decode_sample, reads, stages
from imgtrain.data.datasets import imagenet_transforms
from imgtrain.data.decode_sample import MIN_FILES, packing_side, sample_decodes
from imgtrain.data.image_files import ImageFileDataset
from imgtrain.host import dist
from imgtrain.metrics import processor, report
from imgtrain.train import run as run_module

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from photos import render  # noqa: E402  benchmarks/photos.py: photo-like content at quality 90

TRAIN, _ = imagenet_transforms(224, mean=(0.5, 0.5, 0.5))  # a RandomResizedCrop to 224 px and a flip


@pytest.fixture(scope="module")
def photos(tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    """Six photo-like JPEGs of 1600x1200 (1.92 MP): above --max-side 512, and decoded at 1/2 or more for 224 px."""
    root, rng = tmp_path_factory.mktemp("photos"), np.random.default_rng(0)
    paths = []
    for i in range(6):
        (path := root / f"{i}.jpg").write_bytes(render(1600, 1200, rng))
        paths.append(str(path))
    return paths


def files(paths: list[str], scaled: bool = True) -> ImageFileDataset:
    return ImageFileDataset(paths, [0] * len(paths), ["a"], TRAIN, scaled=scaled)


@pytest.mark.parametrize("scaled", [True, False])
def test_the_sample_times_each_way_of_decoding_the_files(photos: list[str], scaled: bool) -> None:
    threads = torch.get_num_threads()
    sample = sample_decodes(files(photos, scaled))
    assert torch.get_num_threads() == threads  # one thread while timing, restored after
    assert sample is not None and json.loads(json.dumps(sample)) == sample
    assert (sample["files"], sample["megapixels"], sample["longer_side"], sample["crop"]) == (6, 1.92, 1600, 224)
    assert sample["scaled_decode"] is scaled and sample["as_run"] == ("scaled" if scaled else "full")
    assert sample["max_side"] == 512 and all(sample["ms"][name] > 0 for name in ("full", "scaled", "packed"))
    for speedup in (sample["packed_speedup"], sample["scaled_speedup"]):
        low, high = speedup["quartiles"]
        assert low <= speedup["median"] <= high
    assert sample["packed_speedup"]["median"] > 1  # 512x384 against 1600x1200 (or 800x600 at 1/2): several times


def test_the_sample_stops_at_its_time_budget_and_needs_enough_jpegs(photos: list[str], tmp_path: Path) -> None:
    assert sample_decodes(files(photos), budget_s=0.0)["files"] == MIN_FILES  # past the budget: only the least
    pngs = []
    for i in range(8):
        Image.new("RGB", (800, 600), (i * 30, 0, 0)).save(path := tmp_path / f"{i}.png")
        pngs.append(str(path))
    assert sample_decodes(files(pngs)) is None  # no JPEG: nothing to time
    assert sample_decodes(files(photos[: MIN_FILES - 1] + pngs)) is None  # too few JPEGs for a median
    assert sample_decodes(TensorDataset(torch.zeros(8, 3, 32, 32))) is None  # not image files
    assert sample_decodes(files([])) is None


def test_the_side_packed_leaves_twice_the_crop() -> None:
    assert (packing_side(224), packing_side(384), packing_side(None)) == (512, 768, 512)


SAMPLE = {
    "files": 24,
    "megapixels": 6.1,
    "longer_side": 3000,
    "crop": 224,
    "scaled_decode": False,
    "as_run": "full",
    "max_side": 512,
    "ms": {"full": 48.0, "scaled": 34.0, "packed": 2.6},
    "packed_speedup": {"median": 18.2, "quartiles": [15.1, 21.0]},
    "scaled_speedup": {"median": 1.4, "quartiles": [1.3, 1.5]},
    "seconds": 2.9,
    "source": ["/data/photos"],
}


def bound(sample: dict | None, wait: float = 0.4, **extra) -> dict:
    """A summary of a decode-bound run (41.20 of 43.00 ms per image in decode) with `sample` as its files'."""
    per_image = dict.fromkeys(stages.STAGES) | {"read": 0.1, "decode": 41.2, "augment": 1.7}
    pipeline = {"stage_ms_per_image": per_image, "worker_busy_frac": 0.9, "worker_busy_cores": 3.6, "workers": 4}
    pipeline |= {"transfer_frac_of_wait": 0.1, "compute_images_per_sec": None, "decode_sample": sample}
    pipeline |= extra.pop("pipeline", {})
    loader = {"num_workers": 4, "pin_memory": True, "persistent_workers": True, "prefetch_factor": 2}
    summary = {"mode": "train", "data_wait_frac": wait, "loader": loader, "world_size": 1, "local_world_size": 1}
    summary |= {"cpu_count": 8, "device": "cuda:0", "pipeline": pipeline, "dataset": "imagefolder"}
    return summary | {"dataset_root": "/data/photos"} | extra


def test_a_decode_bound_verdict_prescribes_packing_with_the_files_figures() -> None:
    assert report.verdict(bound(SAMPLE)) == (
        "input-bound: 40% of step time waits for data; decode takes the most input time (41.20 of 43.00 ms per "
        "image): the 24 JPEGs sampled are 6.1 MP (median) and decode in 48.0 ms each; packed at --max-side 512 they "
        "decode 18.2x faster (files 15.1-21.0x): `imgtrain-shards /data/photos <local dir> --max-side 512`, then "
        "dataset=shards dataset.root=<local dir>; scaled decoding (dataset.scaled_decode=true) decodes them 1.4x "
        "faster (files 1.3-1.5x); or try data.num_workers=7"
    )
    scaled_on = report.verdict(bound(SAMPLE | {"scaled_decode": True, "as_run": "scaled"}))
    assert "decode in 34.0 ms each with scaled decoding (dataset.scaled_decode=true, on in this run)" in scaled_on
    assert "scaled decoding (dataset.scaled_decode=true) decodes" not in scaled_on
    csv = report.verdict(bound(SAMPLE | {"source": ["my data/train.csv", "--val", "my data/val.csv"]}))
    command = "`imgtrain-shards 'my data/train.csv' <local dir> --val 'my data/val.csv' --max-side 512`"
    assert command in csv


def test_the_contended_verdict_prescribes_the_same() -> None:
    contended = bound(SAMPLE, wait=0.02, pipeline={"compute_images_per_sec": 400.0}, images_per_sec_per_process=90.0)
    verdict = report.verdict(contended)
    assert verdict.startswith("CPU-contended: training ran at 90.0 images/s") and report.decode_bound(contended)
    assert "take decode off these CPUs: the 24 JPEGs sampled are 6.1 MP (median)" in verdict
    assert "`imgtrain-shards /data/photos <local dir> --max-side 512`" in verdict


@pytest.mark.parametrize(
    "sample",
    [
        None,  # not sampled: shards, a Dataset of one's own, PNGs
        SAMPLE | {"longer_side": 500, "megapixels": 0.19},  # small files: packing keeps them as they are
        SAMPLE | {"packed_speedup": {"median": 1.02, "quartiles": [0.98, 1.05]}},  # no gain to speak of
    ],
)
def test_without_a_sample_worth_packing_for_the_verdict_keeps_its_general_advice(sample: dict | None) -> None:
    verdict = report.verdict(bound(sample))
    assert report.STAGE_ADVICE["decode"] in verdict and "imgtrain-shards" not in verdict


def test_only_a_run_bound_by_decoding_is_sampled() -> None:
    assert report.decode_bound(bound(None))
    read_bound = bound(None, pipeline={"stage_ms_per_image": dict.fromkeys(stages.STAGES, 0.1) | {"read": 9.0}})
    assert not report.decode_bound(read_bound)
    assert not report.decode_bound(bound(None, wait=0.02))  # compute-bound
    assert not report.decode_bound(bound(None, mode="loader"))


def test_the_run_hands_its_training_files_to_the_metrics_and_they_sample_them(
    photos: list[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`instruments_for` gives Metrics the training split; at the summary, a decode-bound run's rank 0 times a
    sample of it, keeps it in metrics.json's pipeline block, and its verdict prescribes from it."""
    settings, dataset = validate(compose_cfg(*FAST)), files(photos)
    feed = SimpleNamespace(copy_timer=None, decode_timer=None)
    data = SimpleNamespace(loader_args={"train": {"num_workers": 0}}, feed=feed, bundle=SimpleNamespace(train=dataset))
    built = run_module.instruments_for(settings, dist.DistInfo(), torch.device("cpu"), tmp_path, data, None, {}, 10)
    metrics = next(item for item in built if isinstance(item, processor.Metrics))
    assert metrics.train_set is dataset
    metrics.tb = SimpleNamespace(log_hparams=lambda *args: None, close=lambda: None)
    monkeypatch.setattr(processor, "print_table", lambda summary: None)
    monkeypatch.setattr(processor, "hparams", lambda summary: {})
    monkeypatch.setattr(processor, "hparam_metrics", lambda summary: {})
    summary = bound(None)
    metrics.on_summary(summary, tmp_path / "metrics.json")
    written = json.loads((tmp_path / "metrics.json").read_text())
    sample = written["pipeline"]["decode_sample"]
    assert sample["files"] == len(photos) and sample["source"] == [settings.dataset.root]
    assert f"`imgtrain-shards {shlex.quote(settings.dataset.root)} <local dir> --max-side 512`" in written["verdict"]
    compute_bound = bound(None, wait=0.02)
    metrics.on_summary(compute_bound, tmp_path / "metrics.json")
    assert compute_bound["pipeline"]["decode_sample"] is None  # nothing timed when decoding does not bound it


def test_a_file_that_cannot_be_read_as_a_jpeg_is_left_out(photos: list[str], tmp_path: Path) -> None:
    (broken := tmp_path / "broken.jpg").write_bytes(b"\xff\xd8\xff" + bytes(100))  # a JPEG's magic, no frame
    out = io.BytesIO()
    Image.new("RGB", (64, 48)).save(out, "JPEG")
    (small := tmp_path / "small.jpg").write_bytes(out.getvalue())  # a JPEG at most 512 px: decodes its own bytes
    missing = str(tmp_path / "gone.jpg")
    sample = sample_decodes(files([*photos, str(broken), str(small), missing]))
    assert sample is not None and sample["files"] == len(photos) + 1 and sample["megapixels"] == 1.92


def test_a_fifo_or_a_device_in_the_folder_is_left_out_at_once(photos: list[str], tmp_path: Path) -> None:
    """The sample reads in the training process: a FIFO is refused by its type (its open waited for a writer for
    ever), and so is /dev/zero under an image's name (its read never ended)."""
    os.mkfifo(fifo := tmp_path / "pipe.jpg")
    (zero := tmp_path / "zero.jpg").symlink_to("/dev/zero")
    started = time.monotonic()
    with unblocked(fifo):
        sample = sample_decodes(files([str(fifo), str(zero), *photos]))
    assert time.monotonic() - started < 15
    assert sample is not None and sample["files"] == len(photos)


def test_a_read_that_never_returns_is_left_behind_and_named(
    photos: list[str], monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Hung storage: a read that does not return (here held on an event) is left on the sample's daemon thread
    STUCK_S past LIMIT_S; the run goes on without a sample, and the warning names the file."""
    stuck, real = threading.Event(), reads._read_exactly

    def hung(fd: int, size: int) -> bytearray:
        if os.readlink(f"/proc/self/fd/{fd}") == photos[2]:
            stuck.wait(30)
        return real(fd, size)

    monkeypatch.setattr(reads, "_read_exactly", hung)
    monkeypatch.setattr(decode_sample, "LIMIT_S", 0.5)
    monkeypatch.setattr(decode_sample, "STUCK_S", 0.5)
    try:
        with caplog.at_level(logging.WARNING, logger="imgtrain.data.decode_sample"):
            assert sample_decodes(files(photos[2:3] * 8)) is None  # every file drawn is the held one
    finally:
        stuck.set()
    assert f"the decode sample gave up waiting: {photos[2]} has not been read and decoded" in caplog.text
