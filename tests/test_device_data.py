"""Device-resident data: batched crop/flip, the same order as the DataLoader path, exact resume; CUDA prefetch."""

from __future__ import annotations

import pytest
import torch

from imgtrain.device_data import CudaPrefetcher, ResidentLoader, pad_crop_flip
from imgtrain.loader import Batch, EpochSampler


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


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_prefetcher_yields_every_batch_on_the_device() -> None:
    batches = [
        Batch(torch.full((2, 3, 4, 4), i, dtype=torch.uint8).pin_memory(), torch.tensor([i, i])) for i in range(5)
    ]
    out = list(CudaPrefetcher(iter(batches), torch.device("cuda", 0)))
    assert [b.labels.tolist() for b in out] == [[i, i] for i in range(5)]
    assert all(b.images.is_cuda and int(b.images[0, 0, 0, 0]) == i for i, b in enumerate(out))


def test_encoded_jpegs_collate_as_a_list_and_decode_in_one_call(tmp_path) -> None:
    """dataset.decode=cuda's path, run on the CPU: the code is the same, only decode_jpeg's device differs."""
    from imgtrain.datasets import EncodedFileDataset, ImageFileDataset, build_shapes, eval_transform
    from imgtrain.device_data import decode_on_device
    from imgtrain.loader import GuardedSamples, collate

    bundle = build_shapes("shapes", 32, [0.5] * 3, [0.25] * 3, False, str(tmp_path), 20, 10, 0)
    paths = [bundle.train.path(i) for i in range(4)]
    encoded = GuardedSamples(EncodedFileDataset(paths, [0, 1, 2, 3], bundle.classes, eval_transform(24)))
    batch = collate([encoded[i] for i in range(4)])
    assert isinstance(batch.images, list) and batch.images[0].dim() == 1 and batch.labels.tolist() == [0, 1, 2, 3]
    images = decode_on_device(batch.images, eval_transform(24), torch.device("cpu"))
    assert images.shape == (4, 3, 24, 24) and images.dtype == torch.uint8
    decoded_by_workers = ImageFileDataset(paths, [0, 1, 2, 3], bundle.classes, eval_transform(24))
    assert all(torch.equal(images[i], decoded_by_workers[i][0]) for i in range(4))  # the same pixels either way


def test_gpu_decode_without_a_gpu_is_one_clear_line(tmp_path, data_dir) -> None:
    from helpers import FAST, run_train

    from imgtrain.shapes import ensure_shapes

    root = ensure_shapes(str(tmp_path / "folder"), 32, 40, 10, 0)
    fast = [o for o in FAST if not o.startswith(("dataset.num_train", "dataset.num_val"))]
    args = [*fast, "dataset=imagefolder", f"dataset.root={root}", "dataset.image_size=32", "dataset.decode=cuda"]
    result = run_train([*args, "trainer.device=cpu"], tmp_path / "run", data_dir)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert (
        "error: dataset.decode=cuda needs a CUDA device, and this run uses cpu: use dataset.decode=cpu" in result.stderr
    )
