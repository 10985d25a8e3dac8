"""The crop, resize, flip and random erasing of data.augment_on=device (the default for 32-px shapes on CUDA: auto)
on a real GPU: `make test-gpu`. Skipped where no CUDA device is visible.

tests/test_resample.py checks the device half on the CPU, and tests/test_gpu.py's no-sync cases (shapes, compiled)
run it in training; here the same batch cropped on the GPU must match the CPU's crops within rounding
(data/resample.py crops in float16 on CUDA, float32 on the CPU), erased rectangles and all.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from imgtrain.config.fields import AugmentOn
from imgtrain.data.datasets import build_shapes
from imgtrain.data.samples import GuardedSamples, RawBatch, collate

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device: run `make test-gpu` on a GPU"),
]
CUDA = torch.device("cuda", 0)
# float16 products on the GPU against float32 on the CPU, in 0..255 levels: data/resample.py measured float16 within
# 0.24 levels of float32 on the CPU. A wrong crop, flip or erased box differs by tens of levels.
MEAN_ABS_MAX, MAX_ABS_MAX = 0.25, 2.0


def test_device_crop_and_erasing_match_the_cpu_within_rounding(tmp_path: Path) -> None:
    bundle = build_shapes("shapes", 32, [0.5] * 3, [0.25] * 3, True, str(tmp_path), 128, 8, 0, random_erasing=0.5)
    items = [(i, 1000 + i) for i in range(128)]
    raw = collate(GuardedSamples(bundle.train, replace=True, augment_on=AugmentOn.device).__getitems__(items)).images
    assert isinstance(raw, RawBatch) and raw.erase is not None
    erased = raw.erase[:, 2] * raw.erase[:, 3] > 0
    assert 0 < erased.sum() < len(items)  # some boxes, not all: p = 0.5
    on_cpu = raw.resampled()
    on_gpu = raw.to(CUDA, non_blocking=False).resampled()
    assert on_gpu.is_cuda and on_gpu.shape == on_cpu.shape == (128, 3, 32, 32)
    diff = (on_gpu.float().cpu() - on_cpu.float()).abs()
    print(f"device crop on the GPU against the CPU: mean |diff| {diff.mean():.3f} levels, max {diff.max():.2f}")
    assert diff.mean() <= MEAN_ABS_MAX and diff.max() <= MAX_ABS_MAX
    top, left, height, width = (int(v) for v in raw.erase[erased.nonzero()[0, 0]])
    fill = torch.tensor(raw.fill).view(3, 1, 1)
    box = on_gpu[erased.nonzero()[0, 0], :, top : top + height, left : left + width].float().cpu()
    assert torch.allclose(box, fill.expand_as(box), atol=0.5)  # the erased box holds the fill on the GPU too
