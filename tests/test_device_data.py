"""Device-resident data: batched crop/flip, the same order as the DataLoader path, exact resume; CUDA prefetch."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from helpers import compose_cfg

from imgtrain.common.errors import RunError
from imgtrain.data.batched import pad_crop_flip
from imgtrain.data.feed import ResidentLoader
from imgtrain.data.jpeg import EncodedBatch
from imgtrain.data.samplers import EpochSampler
from imgtrain.data.samples import Batch
from imgtrain.data.shapes import ensure_shapes
from imgtrain.train.run import run


def test_pad_crop_flip_matches_a_per_image_reference() -> None:
    images = torch.randint(0, 256, (6, 3, 8, 8), dtype=torch.uint8)
    seeds = torch.tensor([0, 1, 9, 80, 81, 12345])
    out = pad_crop_flip(images, seeds, pad=4)
    padded = torch.nn.functional.pad(images, (4, 4, 4, 4))
    for i, seed in enumerate(seeds.tolist()):
        dx, dy, flip = seed % 9, (seed // 9) % 9, (seed // 81) % 2 == 1
        expected = padded[i, :, dy : dy + 8, dx : dx + 8]
        assert torch.equal(out[i], expected.flip(-1) if flip else expected)
    assert out.dtype == torch.uint8 and out.shape == images.shape


def test_resident_loader_follows_the_epoch_sampler_and_resumes_exactly() -> None:
    images = torch.arange(20, dtype=torch.uint8).view(20, 1, 1, 1).expand(20, 3, 4, 4).contiguous()
    labels = torch.arange(20)

    def epoch(start: int) -> list[Batch]:
        sampler = EpochSampler(20, num_replicas=1, rank=0, shuffle=True, seed=1, drop_last=True)
        sampler.set_epoch(3, start=start)
        return list(ResidentLoader(images, labels, sampler, 4, drop_last=True, augment=True))

    full, resumed = epoch(0), epoch(8)
    assert len(full) == 5 and len(resumed) == 3
    order = [i for i, _ in EpochSampler(20, num_replicas=1, rank=0, shuffle=True, seed=1, drop_last=True)]
    assert torch.cat([b.labels for b in full]).tolist() != order  # set_epoch(3) reshuffled
    for a, b in zip(full[2:], resumed, strict=True):
        assert torch.equal(a.labels, b.labels) and torch.equal(a.images, b.images)  # same crops and flips too


def test_encoded_jpegs_collate_as_a_list_and_decode_in_one_call(tmp_path) -> None:
    """dataset.decode=cuda's path, run on the CPU: the code is the same, only decode_jpeg's device differs."""
    from imgtrain.data.datasets import EncodedFileDataset, ImageFileDataset, build_shapes, eval_transform
    from imgtrain.data.gpu_decode import JpegBatchDecoder
    from imgtrain.data.samples import GuardedSamples, collate

    bundle = build_shapes("shapes", 32, [0.5] * 3, [0.25] * 3, False, str(tmp_path), 20, 10, 0)
    paths = [bundle.train.path(i) for i in range(4)]
    encoded = GuardedSamples(EncodedFileDataset(paths, [0, 1, 2, 3], bundle.classes, eval_transform(24)))
    batch = collate([encoded[i] for i in range(4)])
    files = batch.images.files()  # one byte buffer, split into the four files
    assert len(files) == 4 and files[0].dim() == 1 and batch.labels.tolist() == [0, 1, 2, 3]
    assert [bytes(f.numpy()) for f in files] == [Path(p).read_bytes() for p in paths]
    assert batch.sources == tuple(paths)
    decoded = JpegBatchDecoder(eval_transform(24))(batch, torch.device("cpu"))
    assert decoded.images.shape == (4, 3, 24, 24) and decoded.images.dtype == torch.float32  # 0..255, unrounded
    decoded_by_workers = ImageFileDataset(paths, [0, 1, 2, 3], bundle.classes, eval_transform(24))
    by_workers = torch.stack([decoded_by_workers[i][0] for i in range(4)]).float()
    assert (decoded.images - by_workers).abs().max() <= 1.0  # torchvision's uint8 rounding, no more


def test_a_batch_decode_failure_replaces_only_the_bad_file_and_reports_it(tmp_path) -> None:
    """One file the decoder rejects mid-stream: the rest of the batch decodes, the bad one is replaced and named."""
    from imgtrain.data.datasets import build_shapes, eval_transform, train_transform
    from imgtrain.data.gpu_decode import JpegBatchDecoder

    bundle = build_shapes("shapes", 32, [0.5] * 3, [0.25] * 3, False, str(tmp_path), 20, 10, 0)
    paths = [bundle.train.path(i) for i in range(4)]
    data = [torch.frombuffer(bytearray(Path(p).read_bytes()), dtype=torch.uint8) for p in paths]
    broken = data[1][: data[1].numel() // 2].clone()  # cut short: torchvision's decoders refuse it
    batch = Batch(EncodedBatch.pack([data[0], broken, data[2], data[3]]), torch.tensor([0, 1, 2, 3]), (), tuple(paths))
    out = JpegBatchDecoder(train_transform(24))(batch, torch.device("cpu"))
    assert out.images.shape == (4, 3, 24, 24)
    assert out.labels.tolist() == [0, 2, 2, 3]  # the stand-in is the next readable image, with its label
    assert len(out.skipped) == 1 and out.skipped[0][0] == paths[1]
    dropped = JpegBatchDecoder(eval_transform(24), drop=True)(batch, torch.device("cpu"))  # validation
    assert dropped.images.shape == (3, 3, 24, 24) and dropped.labels.tolist() == [0, 2, 3]
    assert batch.labels.tolist() == [0, 1, 2, 3]  # the loader's own tensor is left as it was


def test_gpu_decode_without_a_gpu_is_one_clear_line(tmp_path, data_dir) -> None:
    from helpers import compose_cfg

    from imgtrain.common.errors import ConfigError
    from imgtrain.data.shapes import ensure_shapes
    from imgtrain.train.run import run

    root = ensure_shapes(str(tmp_path / "folder"), 32, 40, 10, 0)
    args = ["dataset=imagefolder", f"dataset.root={root}", "dataset.image_size=32", "dataset.decode=cuda"]
    expected = "dataset.decode=cuda needs a CUDA device, and this run uses cpu: use dataset.decode=cpu"
    with pytest.raises(ConfigError, match=expected):
        run(compose_cfg(*args, "system.device=cpu", output_dir=str(tmp_path / "run")))


def test_the_decode_thread_keeps_order_ends_cleanly_and_hands_errors_over(tmp_path) -> None:
    """dataset.decode=cuda's background stage, run on the CPU: the same thread and queue, no CUDA stream."""
    from imgtrain.data.datasets import build_shapes, train_transform
    from imgtrain.data.gpu_decode import GpuJpegBatches

    bundle = build_shapes("shapes", 32, [0.5] * 3, [0.25] * 3, False, str(tmp_path), 40, 10, 0)
    paths = [bundle.train.path(i) for i in range(40)]
    data = [torch.frombuffer(bytearray(Path(p).read_bytes()), dtype=torch.uint8) for p in paths]
    batches = [
        Batch(EncodedBatch.pack(data[i : i + 8]), torch.arange(i, i + 8), (), tuple(paths[i : i + 8]))
        for i in range(0, 40, 8)
    ]
    cpu = torch.device("cpu")
    with GpuJpegBatches(iter(batches), train_transform(24), cpu) as stage:
        out = list(stage)
        assert next(stage, None) is None  # stays exhausted
    assert [b.labels.tolist() for b in out] == [b.labels.tolist() for b in batches]
    assert all(b.images.shape == (8, 3, 24, 24) and b.images.dtype == torch.float32 for b in out)
    assert not stage.thread.is_alive()

    with GpuJpegBatches(iter(batches), train_transform(24), cpu, depth=1) as stage:
        next(stage)  # the loop stops early: leaving the block must stop the thread, which is ahead of it
    assert not stage.thread.is_alive()

    def failing():
        yield batches[0]
        raise RuntimeError("DataLoader worker (pid 123) is killed by signal: Killed.")

    with GpuJpegBatches(failing(), train_transform(24), cpu) as stage:
        next(stage)
        with pytest.raises(RuntimeError, match="is killed by signal"):
            next(stage)


# ----------------------------------------------------------------------------- dataset.decode=cuda's streams, faked
def test_a_validation_batch_of_only_unreadable_images_passes_the_decode_stream(tmp_path, monkeypatch) -> None:
    """With drop (validation) a batch of unreadable files decodes to no images: handed over, not crashed on."""
    import fakecuda

    from imgtrain.data.datasets import eval_transform
    from imgtrain.data.gpu_decode import GpuJpegBatches

    fake = fakecuda.install(monkeypatch)
    good, bad = fakecuda.jpeg_batches(tmp_path, 16)
    bad = bad._replace(images=EncodedBatch.pack([data[: data.numel() // 3].clone() for data in bad.images.files()]))
    stage = GpuJpegBatches(iter([good, bad]), eval_transform(24), torch.device("cuda", 0), drop=True)
    fakecuda.decoding_on_the_cpu(stage, eval_transform(24), drop=True)
    with stage:
        first, second = list(stage)
    assert first.images.shape == (8, 3, 24, 24) and second.images is None
    assert second.labels.shape == (0,) and [path for path, _ in second.skipped] == list(bad.sources)
    assert fake.main.calls.count("wait_event") == 2  # the model's stream waits for each batch's decode
    assert [tensor.shape[0] for tensor, _ in fake.recorded] == [8, 8, 0]  # images and labels; no images: skipped


def test_the_decode_thread_never_waits_for_its_own_stream_and_times_it_with_events(tmp_path, monkeypatch) -> None:
    """Stage timings on: each batch's decode-stream work is bracketed by events, read at the window; the thread
    does not synchronize, so it fetches the next batch while the GPU still transforms this one."""
    import fakecuda

    from imgtrain.data.datasets import train_transform
    from imgtrain.data.gpu_decode import GpuJpegBatches
    from imgtrain.data.stages import StreamTimer
    from imgtrain.metrics.stage_breakdown import PipelineMeter

    fake = fakecuda.install(monkeypatch)
    batches = fakecuda.jpeg_batches(tmp_path, 32)
    timer = StreamTimer(torch.device("cuda", 0), enabled=True)
    stage = GpuJpegBatches(iter(batches), train_transform(24), torch.device("cuda", 0), timer=timer)
    fakecuda.decoding_on_the_cpu(stage, train_transform(24), drop=False)
    meter = PipelineMeter(workers=2, decode_timer=timer)
    with stage:
        for batch in stage:
            meter.add(0.0, 0.0, batch.times)
    (decode_stream,) = fake.streams
    assert "synchronize" not in decode_stream.calls
    assert decode_stream.calls.count("record") == 3 * len(batches)  # a span's two events and the hand-over's
    values = meter.close_window(1.0, steady=True)
    assert values["pipeline/gpu_decode_ms_per_batch"] > 0
    per_image = meter.steady["gpu_decode"] / (meter.steady["decodes"] * 8)
    assert meter.steady["decodes"] == len(batches) and per_image > 0


def test_the_compute_ceiling_with_gpu_decode_trains_on_its_device_batch(tmp_path) -> None:
    """mode=compute's batch is already decoded on the device: dataset.decode=cuda leaves it alone."""
    from helpers import compose_cfg

    from imgtrain.config.validate import validate
    from imgtrain.data.pipeline import decodes_on_gpu

    folder = tmp_path / "folder"
    folder.mkdir()
    args = ["dataset=imagefolder", f"dataset.root={folder}", "dataset.decode=cuda"]
    cuda = torch.device("cuda", 0)  # only the device's type is read
    assert decodes_on_gpu(validate(compose_cfg(*args)), cuda)
    assert not decodes_on_gpu(validate(compose_cfg(*args, "mode=compute")), cuda)


def test_gpu_decode_crops_follow_each_samples_seed(tmp_path) -> None:
    """dataset.decode=cuda's path, run on the CPU: a worker packs the batch into one byte buffer with the seeds,
    and the crops and flips drawn from them are the same on a rerun and in another batch (so on a resume)."""
    from imgtrain.data.datasets import EncodedFileDataset, build_shapes, train_transform
    from imgtrain.data.gpu_decode import JpegBatchDecoder
    from imgtrain.data.samples import GuardedSamples, collate

    bundle = build_shapes("shapes", 32, [0.5] * 3, [0.25] * 3, False, str(tmp_path), 20, 10, 0)
    paths = [bundle.train.path(i) for i in range(16)]
    samples = GuardedSamples(EncodedFileDataset(paths, list(range(16)), bundle.classes, train_transform(24)))
    batch = collate(samples.__getitems__([(i, 100 + i) for i in range(16)]))
    assert batch.images.data.dim() == 1 and batch.images.seeds.tolist() == list(range(100, 116))
    decoder, cpu = JpegBatchDecoder(train_transform(24)), torch.device("cpu")
    whole = decoder(batch, cpu).images
    assert torch.equal(whole, decoder(batch, cpu).images)
    later = collate(samples.__getitems__([(i, 100 + i) for i in range(8, 16)]))
    assert torch.equal(decoder(later, cpu).images, whole[8:])
    other_seeds = collate(samples.__getitems__([(i, 200 + i) for i in range(16)]))
    assert not torch.equal(decoder(other_seeds, cpu).images, whole)


def test_device_resident_leaves_unreadable_images_out_counts_them_and_keeps_the_budget(tmp_path, data_dir) -> None:
    """An image folder with one garbage JPEG, data.device_resident=true: the run trains on the others and names
    the file in metrics.json as the streaming path does; with data.max_bad_samples=0, one line before any step."""
    root = Path(ensure_shapes(str(tmp_path / "folder"), 32, 80, 20, 0))
    bad = sorted((root / "train").rglob("*.jpg"))[5]
    bad.write_bytes(b"\xff\xd8\xff\xe0" + bytes(range(256)) * 8)  # a JPEG's first marker, then garbage
    args = ["dataset=imagefolder", f"dataset.root={root}", "dataset.image_size=32", "metrics.compute_probe=false"]
    args += ["metrics.skip_first_steps=1", "metrics.log_every_n_steps=2", "metrics.monitor_interval_s=0.1"]
    args += ["data.device_resident=true", "data.batch_size=16", "data.num_workers=0", "train.max_steps=4"]
    run(compose_cfg(*args, output_dir=str(tmp_path / "run")))
    metrics = json.loads((tmp_path / "run" / "metrics.json").read_text())
    assert metrics["steps"] == 4 and metrics["unreadable_files_count"] == 1 and metrics["skipped_samples"] == 1
    assert metrics["unreadable_files"][0]["path"] == str(bad)
    with pytest.raises(RunError) as refused:
        run(compose_cfg(*args, "data.max_bad_samples=0", output_dir=str(tmp_path / "strict")))
    line = str(refused.value)
    assert (
        "\n" not in line and line.startswith("data.max_bad_samples=0 exceeded: 1 training images") and str(bad) in line
    )
    assert not (tmp_path / "strict" / "metrics.json").exists()
