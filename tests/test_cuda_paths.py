"""The CUDA input paths' defects found by reading them (issue 29), each checked on the CPU: CUDA's streams, events
and copies are faked (fakecuda.py), the code's own logic runs as it does on a GPU.

- dataset.decode=cuda's batches keep their stage times and paths (else no read, transfer or GPU-decode figure);
- a RawBatch (data.augment_on=device) records its plan on the training stream as well as its images;
- a validation batch whose files the workers all rejected passes the decoder;
- the decode thread copies labels to the GPU from pinned memory only;
- a failed batched decode retries file by file behind one fence, not one per file;
- data.augment_on=device never ships a batch's canvas larger than the device's chunk (one huge photo).
"""

from __future__ import annotations

from pathlib import Path

import fakecuda
import numpy as np
import pytest
import torch

from imgtrain.config.fields import AugmentOn
from imgtrain.data import batched, gpu_decode, resample, samples
from imgtrain.data.ahead import BatchesAhead
from imgtrain.data.datasets import eval_transform, train_transform
from imgtrain.data.gpu_decode import GpuJpegBatches, JpegBatchDecoder
from imgtrain.data.jpeg import EncodedBatch
from imgtrain.data.samples import Batch, RawBatch, Uncropped, collate
from imgtrain.data.stages import StreamTimer
from imgtrain.metrics.stage_breakdown import PipelineMeter

CPU, CUDA = torch.device("cpu"), torch.device("cuda", 0)  # CUDA: faked streams; the tensors stay on the CPU


def _cut_short(batch: Batch, which: list[int]) -> Batch:
    """`batch` with the files at `which` cut to a third: torchvision's decoders refuse them."""
    files = [f[: f.numel() // 3].clone() if i in which else f for i, f in enumerate(batch.images.files())]
    return batch._replace(images=EncodedBatch.pack(files, batch.images.seeds.tolist()))


def test_gpu_decoded_batches_keep_their_stage_times_and_paths(tmp_path: Path, monkeypatch) -> None:
    """Through the decode thread, as a run has it: the run's breakdown has read and gpu_decode figures."""
    fakecuda.install(monkeypatch)
    batches = fakecuda.jpeg_batches(tmp_path, 32)
    timer = StreamTimer(CUDA, enabled=True)
    stage = GpuJpegBatches(iter(batches), train_transform(24), CUDA, timer=timer)
    fakecuda.decoding_on_the_cpu(stage, train_transform(24), drop=False)
    meter = PipelineMeter(workers=2, decode_timer=timer)
    with stage:
        out = list(stage)
    for batch, decoded in zip(batches, out, strict=True):
        assert decoded.times._replace(finished=0.0) == batch.times._replace(finished=0.0)
        assert decoded.times.finished > batch.times.finished  # handed over by the decode thread, after the worker
        assert decoded.sources == batch.sources
        meter.add(0.002, 0.001, decoded.times)
    meter.close_window(1.0, steady=True)
    stages = meter.summary()["stage_ms_per_image"]
    assert stages["read"] > 0 and stages["gpu_decode"] > 0 and stages["transfer"] > 0


def test_a_replaced_or_dropped_file_keeps_the_batch_times_and_names_the_paths(tmp_path: Path) -> None:
    (batch,) = fakecuda.jpeg_batches(tmp_path, 8)
    damaged = _cut_short(batch, [2])
    training = JpegBatchDecoder(train_transform(24))(damaged, CPU)
    assert training.times == batch.times and training.labels.tolist() == [0, 1, 3, 3, 4, 5, 6, 7]
    assert training.sources[2] == batch.sources[3] and [p for p, _ in training.skipped] == [batch.sources[2]]
    validation = JpegBatchDecoder(eval_transform(24), drop=True)(damaged, CPU)
    assert validation.times == batch.times and validation.sources == batch.sources[:2] + batch.sources[3:]


def test_a_validation_batch_the_workers_rejected_whole_passes_the_decoder(tmp_path: Path, monkeypatch) -> None:
    """collate's batch when every file failed in the workers: no images at all (not undecodable bytes)."""
    fake = fakecuda.install(monkeypatch)
    (good,) = fakecuda.jpeg_batches(tmp_path, 8)
    rejected = Batch(None, torch.empty(0, dtype=torch.long), (("a.jpg", "truncated JPEG"),), (), good.times)
    stage = GpuJpegBatches(iter([good, rejected]), eval_transform(24), CUDA, drop=True)
    fakecuda.decoding_on_the_cpu(stage, eval_transform(24), drop=True)
    with stage:
        first, second = list(stage)
    assert first.images.shape == (8, 3, 24, 24) and second.images is None and second.labels.shape == (0,)
    assert second.skipped == rejected.skipped and second.times.samples == good.times.samples
    assert fake.main.calls.count("wait_event") == 2


def test_a_raw_batch_records_its_plan_on_the_training_stream(monkeypatch) -> None:
    """data.augment_on=device: the [B, 11] plan is copied on the prefetch stream and read by the crop on the
    training stream, so its block must not go back to the allocator's pool for the prefetch stream before."""
    fake = fakecuda.install(monkeypatch)
    raw = [
        Batch(RawBatch(torch.zeros(4, 3, 8, 8, dtype=torch.uint8), torch.zeros(4, 11), 6), torch.arange(4))
        for _ in range(3)
    ]
    with BatchesAhead(iter(raw), lambda batch: batch, CUDA, name="prefetch") as ahead:  # the copy left out
        for batch in ahead:
            assert batch.images.size == 6
    recorded = [(id(tensor), stream.name) for tensor, stream in fake.recorded]
    for batch in raw:
        for tensor in (batch.images.images, batch.images.plan, batch.labels):
            assert (id(tensor), "main") in recorded


def test_the_decode_thread_copies_labels_from_pinned_memory_only(tmp_path: Path, monkeypatch) -> None:
    """A `non_blocking` copy from pageable memory waits for the stream's queued kernels: every label copy to the
    GPU, with and without an unreadable file to replace or drop, starts from a pinned tensor."""
    (batch,) = fakecuda.jpeg_batches(tmp_path, 8)
    real_decode = gpu_decode.decode_jpegs
    monkeypatch.setattr(gpu_decode, "decode_jpegs", lambda files, device: real_decode(files, CPU))
    pinned, copies = set(), []
    real_to = torch.Tensor.to

    def pin(tensor: torch.Tensor) -> torch.Tensor:
        copy = tensor.clone()
        pinned.add(id(copy))
        return copy

    def to(tensor: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        target = args[0] if args else kwargs.get("device")
        if isinstance(target, torch.device) and target.type == "cuda":
            copies.append((id(tensor) in pinned, kwargs.get("non_blocking", False)))
            return tensor
        return real_to(tensor, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "pin_memory", pin)
    monkeypatch.setattr(torch.Tensor, "is_pinned", lambda tensor: id(tensor) in pinned)
    monkeypatch.setattr(torch.Tensor, "to", to)
    for damaged in (batch, _cut_short(batch, [1])):
        JpegBatchDecoder(train_transform(24))(damaged, CUDA)
        JpegBatchDecoder(eval_transform(24), drop=True)(damaged, CUDA)
    assert copies == [(True, True)] * 4  # (from pinned memory, non_blocking) each
    JpegBatchDecoder(eval_transform(24), drop=True)(Batch(None, torch.empty(0, dtype=torch.long)), CUDA)
    assert copies == [(True, True)] * 5


def test_a_failed_batch_decode_retries_file_by_file_behind_one_fence(tmp_path: Path, monkeypatch) -> None:
    """One bad file fails torchvision's batched call; the retry decodes each file alone, and drains the stream
    once for all of them (the decodes queue no kernel in between), not once per file."""
    fake = fakecuda.install(monkeypatch)
    (batch,) = fakecuda.jpeg_batches(tmp_path, 8)
    real = gpu_decode.decode_jpeg
    calls = []

    def decode_on_the_cpu(files, mode, device):
        calls.append(len(files))
        return real(files, mode=mode, device=CPU)

    monkeypatch.setattr(gpu_decode, "decode_jpeg", decode_on_the_cpu)
    decoded = gpu_decode.decode_jpegs(_cut_short(batch, [5]).images.files(), CUDA)
    assert calls == [8] + [1] * 8 and fake.main.calls.count("synchronize") == 2
    assert [isinstance(image, str) for image in decoded] == [i == 5 for i in range(8)]
    assert np.all([tuple(image.shape) == (3, 32, 32) for i, image in enumerate(decoded) if i != 5])


@pytest.mark.parametrize("failing", [[], [0]], ids=["clean", "one bad file"])
def test_the_fence_precedes_every_decode(tmp_path: Path, monkeypatch, failing: list[int]) -> None:
    """No decode_jpeg call without the stream drained first (nvJPEG ignores stream order)."""
    fake = fakecuda.install(monkeypatch)
    (batch,) = fakecuda.jpeg_batches(tmp_path, 8)
    real = gpu_decode.decode_jpeg
    order = []
    monkeypatch.setattr(fake.main, "synchronize", lambda: order.append("fence"))

    def decode_on_the_cpu(files, mode, device):
        order.append("decode")
        return real(files, mode=mode, device=CPU)

    monkeypatch.setattr(gpu_decode, "decode_jpeg", decode_on_the_cpu)
    gpu_decode.decode_jpegs(_cut_short(batch, failing).images.files(), CUDA)
    assert order[0] == "fence" and (not failing or order[1:3] == ["decode", "fence"])


def test_a_device_batch_with_one_huge_photo_is_cropped_in_the_worker() -> None:
    """Its canvas of windows is padded to the photo's window: 63 ImageNet-sized images and one 4000x3000 photo would
    ship over 256 MiB (never made here: its size is computed from the plans). Without the photo: a RawBatch."""
    spec = batched.CropSpec(24, (0.35, 1.0), flip_p=0.5)
    images = [torch.zeros(3, *((375, 500) if i % 2 else (500, 375)), dtype=torch.uint8) for i in range(64)]

    def batch(images: list[torch.Tensor]) -> Batch:
        return collate([(Uncropped(image, i, spec, AugmentOn.device), i, (), None) for i, image in enumerate(images)])

    assert isinstance(batch(images).images, RawBatch)
    images[-1] = torch.zeros(3, 3000, 4000, dtype=torch.uint8)
    plans = resample.plan_batch(*resample.sizes_of(images), np.arange(64), spec)
    assert resample.window_canvas_bytes(images, plans, spec.size) > samples.DEVICE_CANVAS_MAX_BYTES
    cropped = batch(images).images
    assert isinstance(cropped, torch.Tensor) and cropped.shape == (64, 3, 24, 24) and cropped.dtype == torch.uint8
