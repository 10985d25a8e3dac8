"""dataset.gpu_decoder=nvimgcodec on a GPU (data/region_decode.py): the hardware engine's and the CUDA decoder's
regions against torchvision's full decode, and the stream-order hazard fenced. Skipped without CUDA or without the
gpu-decode extra; tests/test_gpu_decode_regions.py runs the same code on the CPU backend."""

from __future__ import annotations

import itertools

import pytest
import torch
from test_gpu_decode_regions import SIZE, encoded, files  # noqa: F401  the kinds' files, a fixture

from imgtrain.data import codec_engine, region_probe
from imgtrain.data.codec_engine import CodecDecoder
from imgtrain.data.datasets import eval_transform, train_transform
from imgtrain.data.gpu_decode import GpuJpegBatches, JpegBatchDecoder
from imgtrain.data.region_decode import RegionBatchDecoder

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device: run `make test-gpu` on a GPU"),
]
CUDA = torch.device("cuda", 0)
# Two GPU decoders (nvImageCodec's backends and torchvision's nvJPEG call) may differ in IDCT and chroma upsampling
# by a level or two, as nvJPEG and libjpeg-turbo do (tests/test_gpu.py); another image differs by tens
MEAN_ABS_MAX = 2.0


@pytest.mark.parametrize("split", ["train", "val"])
def test_nvimgcodec_regions_on_the_gpu_crop_what_torchvision_crops(files: list[str], split: str) -> None:  # noqa: F811
    """Every kind (progressive and 4:1:1 fall to the CUDA decoder), EXIF turns included; the probe's answer and
    the largest difference printed for the record."""
    found = region_probe.probe_in_child(0, region_probe.GPU_BACKENDS)
    print(f"region probe on {torch.cuda.get_device_name(0)}: {found}")
    train = split == "train"
    transform = train_transform(SIZE) if train else eval_transform(SIZE)
    items = [(i % len(files), 500 + i) for i in range(2 * len(files))] if train else list(range(len(files)))
    batch = encoded(files, items)
    ours = RegionBatchDecoder(transform, drop=not train)(batch, CUDA)
    reference = JpegBatchDecoder(transform, drop=not train)(batch, CUDA)
    assert not ours.skipped and ours.images.shape == reference.images.shape == (len(items), 3, SIZE, SIZE)
    difference = (ours.images.float() - reference.images.float()).abs().mean(dim=(1, 2, 3))
    print(f"nvImageCodec against torchvision, per image: mean {difference.mean():.3f}, max {difference.max():.3f}")
    assert difference.max() <= MEAN_ABS_MAX


def test_nvimgcodec_decodes_never_overwrite_memory_that_queued_kernels_still_read(files: list[str]) -> None:  # noqa: F811
    """pytorch/vision#9606's harness (tests/test_gpu.py) on CodecDecoder.decode: tensors freed while their reductions
    are queued, then a decode on the same stream; every reduction and every decoded checksum exact."""
    decoder = CodecDecoder(CUDA)
    batch = encoded(files, list(range(len(files))))
    streams = decoder.streams(batch.images.files())
    torch.cuda.synchronize()
    expected = torch.stack([i.to(torch.int64).sum() for i in decoder.decode(streams)])
    weight = torch.randn(4096, 4096, device=CUDA)
    want = torch.arange(16, dtype=torch.float32, device=CUDA) * (1 << 14)
    reductions, checksums = [], []
    for _ in range(120):
        tensors = [torch.full((1 << 14,), float(k), device=CUDA) for k in range(16)]
        torch.cuda.synchronize()
        for _ in range(4):
            weight = torch.tanh(weight @ weight)
        reductions.append(torch.stack([t.sum() for t in tensors]))
        del tensors
        checksums.append(torch.stack([i.to(torch.int64).sum() for i in decoder.decode(streams)]))
    torch.cuda.synchronize()
    wrong = [i for i, r in enumerate(reductions) if not torch.equal(r, want)]
    corrupted = [i for i, c in enumerate(checksums) if not torch.equal(c, expected)]
    assert wrong == [] and corrupted == [], f"{len(wrong)} reductions and {len(corrupted)} batches corrupted"


def test_nvimgcodec_decode_stream_matches_isolated_decodes_beside_training_kernels(files: list[str]) -> None:  # noqa: F811
    """The decode thread's stream with the region decoder: 120 batches beside training-sized work on the main
    stream, each the checksum it has alone."""
    transform = train_transform(SIZE)
    batches = [encoded(files, [(i % len(files), 31 * k + i) for i in range(16)]) for k in range(6)]
    batches = [b._replace(images=b.images._replace(data=b.images.data.pin_memory())) for b in batches]
    decoder = RegionBatchDecoder(transform)
    expected = []
    for batch in batches:
        torch.cuda.synchronize()
        expected.append(decoder(batch, CUDA).images.double().sum(dim=(1, 2, 3)))
        torch.cuda.synchronize()
    weight = torch.randn(4096, 4096, device=CUDA)
    checksums = []
    stage = GpuJpegBatches(itertools.islice(itertools.cycle(batches), 120), transform, CUDA, decoder=decoder)
    with stage as stream:
        for batch in stream:
            for _ in range(4):
                weight = torch.tanh(weight @ weight)
            checksums.append(batch.images.double().sum(dim=(1, 2, 3)))
    torch.cuda.synchronize()
    close = lambda i, c: torch.allclose(c, expected[i % len(batches)], rtol=1e-4, atol=0)  # noqa: E731
    assert len(checksums) == 120 and [i for i, c in enumerate(checksums) if not close(i, c)] == []
    assert codec_engine._REGIONS  # the probe answered, once for the process


def test_nvimgcodec_writes_into_torch_without_a_copy(files: list[str]) -> None:  # noqa: F811
    """A device image reaches torch through DLPack: the tensor's memory is nvImageCodec's buffer."""
    decoder = CodecDecoder(CUDA)
    (image,) = decoder.decode(decoder.streams(encoded(files[:1], [0]).images.files()))
    assert image.is_cuda and image.data_ptr() == decoder.held[0].__cuda_array_interface__["data"][0]
