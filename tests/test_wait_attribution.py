"""The data wait is booked to the stage that is slow, on every path a batch takes to the model.

A worker whose decode is slow makes the loop wait; the breakdown must name decode, and the part of the wait it calls
transfer (from the worker's finished batch to the loop holding it) must stay small. The CUDA prefetch used to fetch
batch n+1 inside the loop's `next()` for batch n: the wait for the slow worker was then booked as transfer of batch
n, finished long before, and the verdict prescribed fewer bytes per batch for a decode-bound run. The prefetch's
thread (data/ahead.py) runs here on CPU tensors: the same code, without the streams.
"""

from __future__ import annotations

import time
from pathlib import Path

import fakecuda
import pytest
import torch
from helpers import compose_cfg
from torch.utils.data import Dataset

from imgtrain.config.validate import validate
from imgtrain.data.datasets import train_transform
from imgtrain.data.gpu_decode import GpuJpegBatches
from imgtrain.data.pipeline import build_data
from imgtrain.data.stages import BatchTimes, StreamTimer, transfer_seconds
from imgtrain.host import dist
from imgtrain.metrics.report import input_stage
from imgtrain.metrics.stage_breakdown import PipelineMeter
from imgtrain.train.loop import EpochBatches

CPU = torch.device("cpu")

SLOW_S = 0.01  # per image in the worker; a batch of 4: 40 ms, while the loop here takes each batch at once
BATCHES = 12


class SlowDecode(Dataset):
    """A user's Dataset whose __getitem__ takes SLOW_S (it records no stages: its time counts as decode)."""

    def __init__(self, split: str, count: int = 64) -> None:
        self.count = count if split == "train" else 8

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        time.sleep(SLOW_S)
        return torch.full((3, 40, 40), index % 250, dtype=torch.uint8), index % 2


@pytest.mark.parametrize(
    ("path", "overrides"),
    [
        ("workers", []),
        ("prefetch", []),
        ("prefetch, device crop", ["data.augment_on=device"]),
        ("prefetch, loader threads", ["data.engine=threads"]),
    ],
)
def test_a_slow_decode_is_named_decode_not_transfer(tmp_path: Path, path: str, overrides: list[str]) -> None:
    """The run's own data route (build_data, EpochBatches, the feed) with a loop that takes each batch at once, as
    a fast GPU does: the breakdown of the waits names decode."""
    if "threads" in path:
        pytest.importorskip("torchdata")
    args = ["dataset=custom", f"dataset._target_={__name__}.SlowDecode", "dataset.num_classes=2"]
    args += ["dataset.image_size=32", "data.num_workers=1", "data.batch_size=4", *overrides]
    settings = validate(compose_cfg(*args, output_dir=str(tmp_path)))
    data = build_data(settings, dist.DistInfo(), CPU, torch.contiguous_format, tmp_path)
    data.feed.prefetch = "prefetch" in path  # as a CUDA run with pinned memory builds it: the same thread, no streams
    meter = PipelineMeter(workers=1)
    started = time.perf_counter()
    batches = EpochBatches(
        data.train, data.feed, data.settings, BATCHES, on_unreadable=lambda _: None, on_batch=meter.add
    )
    with batches:
        assert sum(1 for _ in batches) == BATCHES
    meter.close_window(time.perf_counter() - started, steady=True)
    data.close()
    figures = meter.summary()
    assert figures["transfer_frac_of_wait"] < 0.5, figures
    assert input_stage(figures) == "decode", figures


def test_gpu_decoded_batches_book_the_wait_for_a_slow_worker_to_the_worker(tmp_path: Path, monkeypatch) -> None:
    """dataset.decode=cuda: the decode thread hands a batch over as soon as it is decoded, so a wait for the worker
    that reads the files is not transfer."""
    fakecuda.install(monkeypatch)
    batches = fakecuda.jpeg_batches(tmp_path, 48)
    cuda = torch.device("cuda", 0)

    def slow_worker():
        for batch in batches:
            time.sleep(0.03)  # the worker reading its files
            yield batch._replace(times=batch.times._replace(read=0.03, finished=time.perf_counter()))

    timer = StreamTimer(cuda, enabled=True)
    stage = GpuJpegBatches(slow_worker(), train_transform(24), cuda, timer=timer)
    fakecuda.decoding_on_the_cpu(stage, train_transform(24), drop=False)
    meter = PipelineMeter(workers=1, decode_timer=timer)
    with stage:
        for _ in range(len(batches)):
            started = time.perf_counter()
            batch = next(stage)
            received = time.perf_counter()
            meter.add(received - started, transfer_seconds(batch.times, started, received), batch.times)
    meter.close_window(1.0, steady=True)
    summary = meter.summary()
    assert summary["transfer_frac_of_wait"] < 0.5, summary
    assert isinstance(batch.times, BatchTimes)
