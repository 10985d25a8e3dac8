"""Every CUDA path, on a real GPU: `make test-gpu`. Skipped (cleanly) where no CUDA device is visible.

Each test asserts something a broken CUDA path would get wrong: bit-identical copies, the CPU reference batch
for batch, decoded pixels within a stated tolerance, checksums under concurrent load, exact resume, and no
host-device sync between two logging windows.
"""

from __future__ import annotations

import itertools
import json
import math
import os
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch
from helpers import FAST, RESUMABLE, compose_cfg, interrupt, read_metrics, run_torchrun, run_train
from PIL import Image
from shardhelpers import shards_args
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from imgtrain.data import gpu_decode
from imgtrain.data.ahead import prefetcher
from imgtrain.data.datasets import EncodedFileDataset, eval_transform
from imgtrain.data.decoders import decode_file
from imgtrain.data.feed import ResidentLoader
from imgtrain.data.folders import list_images
from imgtrain.data.gpu_decode import GpuJpegBatches, JpegBatchDecoder, decode_jpegs
from imgtrain.data.jpeg import EncodedBatch
from imgtrain.data.samplers import EpochSampler
from imgtrain.data.samples import Batch, GuardedSamples, RawBatch, collate
from imgtrain.data.shapes import ensure_shapes
from imgtrain.resilience.checkpoint import Checkpointer, checkpointer
from imgtrain.train import loop
from imgtrain.train.run import run

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device: run `make test-gpu` on a GPU"),
]
CUDA = torch.device("cuda", 0)
# nvJPEG and libjpeg-turbo use different IDCTs and chroma upsampling: decoded pixels differ by a level or two,
# more along sharp colour edges. A wrong decode (another image, garbage, a channel swap) differs by tens.
DECODE_MEAN_ABS_MAX = 2.0  # mean |GPU - CPU| over all pixels, in 0..255 levels
DECODE_P999_MAX = 48  # 99.9th percentile of |GPU - CPU|


def _steps(run_dir: Path, tag: str) -> list[tuple[int, float]]:
    events = EventAccumulator(str(run_dir / "tb"))
    events.Reload()
    return [(e.step, e.value) for e in events.Scalars(tag)] if tag in events.Tags()["scalars"] else []


@pytest.fixture(scope="session")
def jpeg_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An ImageFolder of 96-px shapes JPEGs (train/ and val/), generated once."""
    return Path(ensure_shapes(str(tmp_path_factory.mktemp("jpegs")), 96, 480, 96, 0))


def _encoded_batches(root: Path, batch_size: int, count: int) -> list[Batch]:
    paths, labels, classes = list_images(str(root / "train"))
    dataset = GuardedSamples(EncodedFileDataset(paths[:count], labels[:count], classes, None))
    items = [dataset[i] for i in range(count)]
    return [collate(items[i : i + batch_size]) for i in range(0, count, batch_size)]


# ----------------------------------------------------------------------------- copies and device-resident data
def test_prefetcher_batches_are_bit_identical_to_a_plain_copy() -> None:
    generator = torch.Generator().manual_seed(0)
    batches = [
        Batch(
            torch.randint(0, 256, (128, 3, 32, 32), dtype=torch.uint8, generator=generator).pin_memory(),
            torch.randint(0, 10, (128,), generator=generator).pin_memory(),
        )
        for _ in range(24)
    ]
    weight = torch.randn(2048, 2048, device=CUDA)
    with prefetcher(iter(batches), CUDA) as ahead:
        for batch, copied in zip(batches, ahead, strict=True):
            for _ in range(3):
                weight = torch.tanh(weight @ weight)  # compute on the main stream while the next copy runs
            assert copied.images.is_cuda and torch.equal(copied.images, batch.images.to(CUDA))
            assert torch.equal(copied.labels, batch.labels.to(CUDA))


def test_device_resident_loader_matches_the_cpu_reference() -> None:
    images = torch.randint(0, 256, (300, 3, 16, 16), dtype=torch.uint8, generator=torch.Generator().manual_seed(1))
    labels = torch.arange(300) % 7
    for epoch, start in ((0, 0), (3, 40)):  # a fresh epoch, and one resumed 40 samples in
        loaders = []
        for device in (torch.device("cpu"), CUDA):
            sampler = EpochSampler(300, num_replicas=1, rank=0, shuffle=True, seed=5, drop_last=True)
            sampler.set_epoch(epoch, start=start)
            loaders.append(ResidentLoader(images.to(device), labels.to(device), sampler, 32, augment=True))
        reference, on_gpu = (list(loader) for loader in loaders)
        assert len(reference) == len(on_gpu) > 0
        for a, b in zip(reference, on_gpu, strict=True):
            assert b.images.is_cuda and torch.equal(a.images, b.images.cpu()) and torch.equal(a.labels, b.labels.cpu())


# ----------------------------------------------------------------------------- GPU JPEG decode
def test_gpu_decode_matches_the_cpu_decode_within_tolerance(jpeg_root: Path) -> None:
    paths, _, _ = list_images(str(jpeg_root / "val"))
    paths = paths[:64]
    encoded = [torch.frombuffer(bytearray(Path(p).read_bytes()), dtype=torch.uint8) for p in paths]
    on_gpu = decode_jpegs(encoded, CUDA)
    diffs = []
    for path, image in zip(paths, on_gpu, strict=True):
        assert isinstance(image, torch.Tensor) and image.is_cuda, image
        reference = decode_file(path)
        assert image.shape == reference.shape
        diffs.append((image.cpu().int() - reference.int()).abs().flatten())
    diff = torch.cat(diffs).float()
    mean, p999 = diff.mean().item(), diff.quantile(0.999).item()
    print(f"GPU vs CPU JPEG decode: mean |diff| {mean:.3f} levels, 99.9th percentile {p999:.0f}, max {diff.max():.0f}")
    assert mean <= DECODE_MEAN_ABS_MAX and p999 <= DECODE_P999_MAX
    # The same holds after the validation transform, batched on the GPU, against the workers' CPU transform.
    transform = eval_transform(64)
    batch = Batch(EncodedBatch.pack(encoded), torch.zeros(len(paths), dtype=torch.long), (), tuple(paths))
    decoded = JpegBatchDecoder(transform)(batch, CUDA).images.cpu().float().round().int()  # float16, 0..255
    workers = torch.stack([transform(decode_file(p)) for p in paths]).int()
    assert (decoded - workers).abs().float().mean().item() <= DECODE_MEAN_ABS_MAX


def test_gpu_decode_never_overwrites_memory_that_queued_kernels_still_read(jpeg_root: Path) -> None:
    """The stream-order hazard of pytorch/vision#9606, with its harness, for 240 iterations.

    Each iteration fills tensors, queues long matrix products and then one reduction per tensor, frees the
    tensors while their reductions are still queued, and decodes a batch on the same stream: the caching
    allocator hands the decoder the freed blocks. Unfenced, nvJPEG writes them before the reductions run: 199
    of 240 iterations on an H100 (BENCHMARKS.md 2026-11-23; benchmarks/results/2026-11-23-h100/COMMAND.md).
    Every reduction must keep its exact value, and every decoded batch the checksum it has when decoded alone.
    """
    batches = _encoded_batches(jpeg_root, 32, 256)
    expected = []
    for batch in batches:  # the reference: one batch at a time, nothing else queued
        torch.cuda.synchronize()
        expected.append(torch.stack([i.to(torch.int64).sum() for i in decode_jpegs(batch.images.files(), CUDA)]))
        torch.cuda.synchronize()
    weight = torch.randn(4096, 4096, device=CUDA)
    want = torch.arange(16, dtype=torch.float32, device=CUDA) * (1 << 14)
    reductions, checksums = [], []
    for iteration in range(240):
        tensors = [torch.full((1 << 14,), float(k), device=CUDA) for k in range(16)]
        torch.cuda.synchronize()  # the values are in memory before anything else is queued
        for _ in range(4):
            weight = torch.tanh(weight @ weight)  # ~10 ms of queued work ahead of the reductions
        reductions.append(torch.stack([t.sum() for t in tensors]))
        del tensors  # freed while their reductions are still queued
        images = decode_jpegs(batches[iteration % len(batches)].images.files(), CUDA)
        checksums.append(torch.stack([i.to(torch.int64).sum() for i in images]))
    torch.cuda.synchronize()
    wrong = [i for i, r in enumerate(reductions) if not torch.equal(r, want)]
    corrupted = [i for i, c in enumerate(checksums) if not torch.equal(c, expected[i % len(batches)])]
    assert wrong == [] and corrupted == [], f"{len(wrong)} reductions and {len(corrupted)} batches corrupted"


def test_gpu_decode_stream_matches_isolated_decodes_beside_training_kernels(jpeg_root: Path) -> None:
    """The decode thread's stream: decode and resize 240 batches while the main stream runs training-sized work."""
    batches = [
        b._replace(images=b.images._replace(data=b.images.data.pin_memory()))
        for b in _encoded_batches(jpeg_root, 32, 256)
    ]
    transform = eval_transform(64)
    decoder = JpegBatchDecoder(transform)
    expected = []
    for batch in batches:
        torch.cuda.synchronize()
        expected.append(decoder(batch, CUDA).images.double().sum(dim=(1, 2, 3)))
        torch.cuda.synchronize()
    weight = torch.randn(4096, 4096, device=CUDA)
    checksums = []
    with GpuJpegBatches(itertools.islice(itertools.cycle(batches), 240), transform, CUDA) as stream:
        for batch in stream:
            for _ in range(4):
                weight = torch.tanh(weight @ weight)
            checksums.append(batch.images.double().sum(dim=(1, 2, 3)))
    torch.cuda.synchronize()
    # float16 crops: a matmul on another stream may round differently; one overwritten row moves a sum by ~1%
    close = lambda i, c: torch.allclose(c, expected[i % len(batches)], rtol=1e-4, atol=0)  # noqa: E731
    corrupted = [i for i, c in enumerate(checksums) if not close(i, c)]
    assert len(checksums) == 240 and corrupted == []


def test_truncated_and_cmyk_jpegs_are_skipped_and_counted(tmp_path: Path, data_dir: Path) -> None:
    root = Path(ensure_shapes(str(tmp_path / "folder"), 48, 120, 30, 0))
    train = sorted((root / "train").rglob("*.jpg"))
    truncated, cmyk = train[7], train[50]
    truncated.write_bytes(truncated.read_bytes()[: truncated.stat().st_size // 2])
    with Image.open(cmyk) as image:
        image.convert("CMYK").save(cmyk, "JPEG")
    overrides = [
        "dataset=imagefolder",
        f"dataset.root={root}",
        "dataset.image_size=32",
        "dataset.decode=cuda",
        "data.batch_size=20",
        "data.num_workers=2",
        "train.epochs=2",
        "metrics.skip_first_steps=0",
        "metrics.log_every_n_steps=2",
    ]
    run(compose_cfg(*overrides, output_dir=str(tmp_path / "run")))
    metrics = read_metrics(tmp_path / "run")
    assert metrics["skipped_samples"] == 4  # two files, read once in each of two epochs
    stages = metrics["pipeline"]["stage_ms_per_image"]
    assert stages["gpu_decode"] > 0 and stages["read"] > 0  # decode on the GPU, in the decode thread
    assert stages["decode"] == 0 and stages["h2d"] is None  # workers only read; decoded images are already there
    assert metrics["steps"] == 12 and math.isfinite(metrics["val_loss"])
    env = metrics["environment"]  # the pre-flight fingerprint on a GPU: NVML's driver, nvJPEG's version
    assert env["gpu_name"] == torch.cuda.get_device_name(0) and env["driver"] and env["cudnn"]
    assert env["decoder"]["in_use"].startswith("nvJPEG") and env["decoder"]["nvjpeg"] and env["probe_ms"] < 1000


def test_shards_decode_on_the_gpu_and_count_an_unreadable_jpeg(shards: Path, tmp_path: Path) -> None:
    """dataset=shards with dataset.decode=cuda: the workers read the stored bytes, the GPU decodes; a stored
    image made undecodable is replaced and counted as on the folder path."""
    damaged = tmp_path / "shards"
    shutil.copytree(shards, damaged)
    chunk = sorted((damaged / "train").glob("chunk-*.bin"))[0]
    data = bytearray(chunk.read_bytes())
    start = data.find(b"\xff\xd8\xff")
    data[start : start + 4] = b"XXXX"
    chunk.write_bytes(bytes(data))
    overrides = shards_args(damaged, "dataset.decode=cuda", "data.num_workers=2", "train.epochs=2")
    run(compose_cfg(*overrides, output_dir=str(tmp_path / "run")))
    metrics = read_metrics(tmp_path / "run")
    stages = metrics["pipeline"]["stage_ms_per_image"]
    assert stages["gpu_decode"] > 0 and stages["read"] > 0 and stages["decode"] == 0
    assert metrics["steps"] == 16 and metrics["skipped_samples"] == 2 and math.isfinite(metrics["val_loss"])


# ----------------------------------------------------------------------------- resume and precision
def test_fp32_deterministic_resume_matches_the_uninterrupted_run(tmp_path: Path, data_dir: Path) -> None:
    args = [*RESUMABLE, "system.precision=fp32"]
    straight = tmp_path / "straight"
    result = run_train(args, straight, data_dir)
    assert result.returncode == 0, result.stderr[-3000:]
    part = tmp_path / "part"
    interrupt(args, part, data_dir)  # SIGTERM once the first checkpoint exists
    resumed = run_train(args, part, data_dir)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"resuming from {part / 'checkpoints' / 'last.pt'}" in resumed.stdout
    a, b = read_metrics(straight), read_metrics(part)
    assert a["device"] == "cuda:0" and a["steps"] == b["steps"] == 16
    final_a, final_b = _steps(straight, "train/loss")[-1], _steps(part, "train/loss")[-1]
    print(f"final train loss: uninterrupted {final_a[1]!r}, resumed {final_b[1]!r}; val_loss {a['val_loss']!r}")
    # Deterministic cuDNN and cuBLAS; only atomics in a few backward kernels (adaptive pooling) remain.
    assert final_a[0] == final_b[0] and math.isclose(final_a[1], final_b[1], rel_tol=1e-4)
    assert math.isclose(a["val_loss"], b["val_loss"], rel_tol=1e-4)


def _capture_resumed_step(monkeypatch: pytest.MonkeyPatch) -> list:
    """Record the Step (optimizer, scaler) and the payload each resume restores."""
    seen = []
    real_resume, real_locate = Checkpointer.resume, checkpointer.locate

    def locate(*args):
        found = real_locate(*args)
        seen.append(("payload", found[1] if found else None))
        return found

    def resume(self: Checkpointer, replicas: int = 1):
        progress = real_resume(self, replicas)
        step = self.step_state
        seen.extend([("step", step), ("scaler", step.scaler.state_dict())])  # before training goes on
        return progress

    monkeypatch.setattr(checkpointer, "locate", locate)  # the name Checkpointer.resume calls
    monkeypatch.setattr(Checkpointer, "resume", resume)
    return seen


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_a_mixed_precision_run_resumes_and_continues(
    precision: str, tmp_path: Path, data_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    overrides = [*FAST, f"system.precision={precision}", "checkpoint.every_n_steps=3", "train.epochs=2"]
    run(compose_cfg(*overrides, "train.max_steps=6", output_dir=str(tmp_path)))
    saved = torch.load(tmp_path / "checkpoints" / "last.pt", weights_only=True)
    seen = _capture_resumed_step(monkeypatch)
    run(compose_cfg(*overrides, "train.max_steps=12", output_dir=str(tmp_path)))
    metrics = read_metrics(tmp_path)
    assert metrics["steps"] == 12 and metrics["precision"] == precision and math.isfinite(metrics["val_loss"])
    assert metrics["nonfinite_steps"] == 0
    step = dict(seen)["step"]
    assert step.optimizer.defaults["fused"] is True  # fused AdamW on CUDA
    state = next(iter(step.optimizer.state.values()))
    assert state["exp_avg"].is_cuda and state["step"].is_cuda  # fused keeps `step` on the device: no syncs
    assert dict(seen)["payload"]["progress"]["step"] == 6
    losses = [v for _, v in _steps(tmp_path, "train/loss")]
    assert len(losses) == 6 and all(math.isfinite(v) for v in losses)  # one per 2 steps, before and after
    if precision == "fp16":
        fresh = torch.amp.GradScaler("cuda").state_dict()
        assert saved["scaler"] != fresh  # six steps moved the scale or its growth tracker
        assert dict(seen)["scaler"] == saved["scaler"]  # ... and the resumed run starts from exactly that
    else:
        assert saved["scaler"] == {}  # no scaler with bf16


def test_bf16_channels_last_compiled_trains(tmp_path: Path) -> None:
    overrides = [
        "dataset=synthetic",
        "dataset.image_size=32",
        "dataset.num_train=512",
        "dataset.num_val=64",
        "model=resnet18_cifar",
        "data.batch_size=64",
        "data.num_workers=2",
        "system.precision=bf16",
        "system.channels_last=true",
        "system.compile=true",
        "train.max_steps=8",
        "metrics.skip_first_steps=2",
        "metrics.log_every_n_steps=2",
        "checkpoint.save=false",
    ]
    run(compose_cfg(*overrides, output_dir=str(tmp_path)))
    metrics = read_metrics(tmp_path)
    assert metrics["steps"] == 8 and metrics["precision"] == "bf16" and math.isfinite(metrics["val_loss"])
    assert all(math.isfinite(v) for _, v in _steps(tmp_path, "train/loss"))
    assert metrics["pipeline"]["stage_ms_per_image"]["h2d"] > 0  # the prefetch stream's copies, timed by events
    assert _steps(tmp_path, "pipeline/h2d_ms_per_batch")


def test_cuda_graphs_train_tune_and_validate(tmp_path: Path) -> None:
    """system.compile_mode=reduce_overhead: the step marks let each replay reuse the last one's outputs, the tune
    probe times a copy compiled the same way, validation runs uncompiled, and nonfinite=skip's forwards (a read of
    the loss each step) do not break the graphs."""
    overrides = [
        "dataset=synthetic",
        "dataset.image_size=32",
        "dataset.num_train=2048",
        "dataset.num_val=200",  # a last validation batch of another size: uncompiled, so no new graph
        "model=resnet18_cifar",
        "data.batch_size=128",
        "data.num_workers=tune",
        "data.tune_budget_s=6",
        "system.precision=bf16",
        "system.compile=true",
        "system.compile_mode=reduce_overhead",
        "faults.nonfinite=skip",
        "train.epochs=2",
        "metrics.skip_first_steps=4",
        "metrics.log_every_n_steps=4",
        "checkpoint.save=false",
    ]
    run(compose_cfg(*overrides, output_dir=str(tmp_path)))
    metrics = read_metrics(tmp_path)
    assert metrics["steps"] == 32 and math.isfinite(metrics["val_loss"]) and metrics["val_count"] == 200
    assert all(math.isfinite(v) for _, v in _steps(tmp_path, "train/loss"))
    assert metrics["pipeline"]["compute_images_per_sec"] > 0  # the probe's compiled copy, timed with events


# ----------------------------------------------------------------------------- NVML
def test_nvml_metrics_are_logged_during_a_busy_run(tmp_path: Path) -> None:
    overrides = [
        "dataset=synthetic",
        "dataset.image_size=64",
        "dataset.num_train=16384",
        "dataset.num_val=256",
        "data.batch_size=256",
        "data.num_workers=4",
        "train.epochs=1",
        "metrics.skip_first_steps=4",
        "metrics.log_every_n_steps=8",
        "metrics.monitor_interval_s=0.05",
        "checkpoint.save=false",
    ]
    run(compose_cfg(*overrides, output_dir=str(tmp_path)))
    util, memory = _steps(tmp_path, "gpu/util_pct"), _steps(tmp_path, "gpu/mem_used_gb")
    assert util and memory, "gpu/util_pct and gpu/mem_used_gb must be in TensorBoard"
    assert max(v for _, v in util) > 0 and min(v for _, v in memory) > 0
    assert read_metrics(tmp_path)["gpu_util_mean"] > 0


@pytest.mark.parametrize("visible", ["0", "uuid"])
def test_nvml_follows_cuda_visible_devices(visible: str) -> None:
    """The monitor reads the GPU torch uses, whether CUDA_VISIBLE_DEVICES names it by index or by UUID."""
    uuid = str(torch.cuda.get_device_properties(0).uuid)
    value = f"GPU-{uuid}" if visible == "uuid" else visible
    code = (
        "import torch, pynvml\n"
        "from imgtrain.metrics.monitor import ResourceMonitor, normalize_uuid\n"
        "m = ResourceMonitor(torch.device('cuda', 0))\n"
        "nvml = normalize_uuid(pynvml.nvmlDeviceGetUUID(m._handle))\n"
        "print(m.gpu_available, nvml, normalize_uuid(torch.cuda.get_device_properties(0).uuid))\n"
    )
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": value, "PYTHONPATH": os.pathsep.join(sys.path)}
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    available, nvml_uuid, torch_uuid = result.stdout.split()
    assert available == "True" and nvml_uuid == torch_uuid


# ----------------------------------------------------------------------------- no hidden syncs
SYNTHETIC = ["dataset=synthetic", "dataset.num_train=4096", "dataset.num_val=128", "data.prefetch_to_device=false"]
# the default run's path: shapes JPEGs decoded in the workers, cropped and flipped on the GPU, the prefetch stream
SHAPES = ["dataset=shapes", "dataset.num_train=4096", "dataset.num_val=128", "data.augment_on=device"]
RECIPE = ["train.mixup_alpha=0.2", "train.cutmix_alpha=1.0", "train.ema_decay=0.999", "dataset.random_erasing=0.25"]
SYNC_FREE_PATHS = {  # each path's overrides: 40 steps, each case's training set more than one epoch of them
    "default": SYNTHETIC,  # copies on the main stream
    "prefetcher": [*SYNTHETIC, "data.prefetch_to_device=true"],
    "device_resident": [*SYNTHETIC, "data.device_resident=true"],
    "recipe": [*SYNTHETIC, *RECIPE],  # mixup/cutmix, an EMA updated every step, random erasing in the workers
    "shapes": SHAPES,
    # compiled, channels_last (auto on CUDA), mixup/cutmix, EMA, random erasing on the GPU (issue 1: no recompile)
    "compiled": [*SHAPES, *RECIPE, "system.compile=true"],
    "fp16": [*SYNTHETIC, "system.precision=fp16"],  # the loss scaler, with fused AdamW's on-device inf check
    "decode_cuda": ["dataset=imagefolder", "dataset.decode=cuda"],  # nvJPEG in its thread; dataset.root added below
}


def _decode_thread_fence(fence):
    """gpu_decode.fence, its host wait made through an event in the decode thread alone. That thread waits for its own
    stream before each decode by design (nvJPEG's stream-order bug); the sync-debug mode is process-wide and cannot
    tell it from the training loop's thread, and it does not watch event waits. Any other thread: the real fence."""

    def fenced(device: torch.device) -> None:
        if threading.current_thread().name != "gpu-jpeg-decode":
            return fence(device)
        done = torch.cuda.Event()
        done.record(torch.cuda.current_stream(device))
        done.synchronize()

    return fenced


@pytest.mark.parametrize("path", list(SYNC_FREE_PATHS))
def test_no_host_device_sync_between_two_logging_windows(
    path: str, tmp_path: Path, data_dir: Path, monkeypatch
) -> None:
    """Steady-state steps run under torch.cuda.set_sync_debug_mode("error"): any sync raises. Each path of
    SYNC_FREE_PATHS: the default run's (shapes, augmentation on the GPU), compiled, fp16, GPU JPEG decoding, and the
    recipe: mixup/cutmix on the device batch, random erasing and an EMA updated every step (issue 32)."""
    torch.cuda.set_sync_debug_mode("error")
    with pytest.raises(RuntimeError):  # the detector works on this torch: a .item() is caught
        torch.ones(1, device=CUDA).item()
    torch.cuda.set_sync_debug_mode(0)
    windows = []
    real_close_window = loop.close_window

    def close_window(parts: loop.Components, step: int) -> None:
        torch.cuda.set_sync_debug_mode(0)  # the window reads the loss back (and the faults its NaN flag): by design
        real_close_window(parts, step)
        windows.append(step)
        if len(windows) == 2:  # from the end of the second window to the start of the third: every step checked
            torch.cuda.set_sync_debug_mode("error")

    monkeypatch.setattr(loop, "close_window", close_window)
    resampled = []  # the batches cropped on the GPU (data.augment_on=device): the spy calls through
    real_resampled = RawBatch.resampled
    monkeypatch.setattr(RawBatch, "resampled", lambda self: resampled.append(1) or real_resampled(self))
    overrides = [
        *SYNC_FREE_PATHS[path],
        "dataset.image_size=32",
        "model=resnet18_cifar",
        "data.batch_size=64",
        "data.num_workers=2",
        "train.max_steps=40",
        "metrics.skip_first_steps=2",
        "metrics.log_every_n_steps=10",
        "checkpoint.every_n_steps=0",
    ]
    if path == "decode_cuda":  # the shapes case's JPEGs (4096 train, 128 val, 32 px), generated once
        overrides.append(f"dataset.root={ensure_shapes(str(data_dir / 'shapes'), 32, 4096, 128, 0)}")
        monkeypatch.setattr(gpu_decode, "fence", _decode_thread_fence(gpu_decode.fence))
    try:
        run(compose_cfg(*overrides, output_dir=str(tmp_path)))
    finally:
        torch.cuda.set_sync_debug_mode(0)
    metrics = read_metrics(tmp_path)
    assert len(windows) >= 3 and metrics["steps"] == 40
    stages = metrics["pipeline"]["stage_ms_per_image"]  # each case ran the path it names:
    assert ((stages["gpu_decode"] or 0) > 0 and not stages["decode"]) == (path == "decode_cuda")  # nvJPEG's
    assert (len(resampled) >= 40 and stages["decode"] > 0) == (path in ("shapes", "compiled"))  # JPEGs, GPU crops
    assert (metrics["precision"] == "fp16") == (path == "fp16")


# ----------------------------------------------------------------------------- torchrun
def test_one_process_torchrun_on_nccl(tmp_path: Path, data_dir: Path) -> None:
    """The box has one GPU: this checks the nccl path end to end at world size 1; multi-GPU nccl is untested."""
    run_dir = tmp_path / "run"
    result = run_torchrun([*FAST, f"hydra.run.dir={run_dir}"], tmp_path, data_dir, nproc=1)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "process group: nccl, rank 0 of 1, on cuda:0" in result.stdout + result.stderr
    metrics = json.loads((run_dir / "metrics.json").read_text())
    assert metrics["world_size"] == 1 and metrics["device"] == "cuda:0" and metrics["steps"] == 8
