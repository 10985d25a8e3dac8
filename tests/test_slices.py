"""data.worker_batch_size: workers make slices of a step's batch, joined on the device into the batch a whole-batch
worker makes: the same images in the same order, the same labels, its stage times summed; one line for a size that
does not divide the batch; whole batches by default."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import compose_cfg
from PIL import Image

from imgtrain.common.errors import ConfigError
from imgtrain.config.validate import validate
from imgtrain.data import slices
from imgtrain.data.jpeg import EncodedBatch
from imgtrain.data.pipeline import build_data
from imgtrain.data.samples import Batch, RawBatch
from imgtrain.data.stages import BatchTimes
from imgtrain.host import dist

CPU = torch.device("cpu")


def _folder(root: Path, count: int = 48) -> Path:
    """An image folder of JPEGs of many sizes, two classes."""
    rng = np.random.default_rng(0)
    for i in range(count):
        width, height = (int(v) for v in rng.integers(24, 120, 2))
        folder = root / f"class{i % 2}"
        folder.mkdir(parents=True, exist_ok=True)
        Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8)).save(folder / f"{i:03d}.jpg")
    return root


def _epoch(tmp_path: Path, folder: Path, *overrides: str) -> tuple[list[Batch], dict]:
    """The first epoch's training batches on the CPU, as the run's own route makes them, and the plan shown."""
    args = ["dataset=imagefolder", f"dataset.root={folder}", "dataset.image_size=32", "data.batch_size=16"]
    settings = validate(compose_cfg(*args, *overrides, output_dir=str(tmp_path)))
    data = build_data(settings, dist.DistInfo(), CPU, torch.contiguous_format, tmp_path)
    data.start_epoch(0, 0)
    try:
        batches = list(data.train)
    finally:
        data.close()
    return batches, data.loader_args["train"]


@pytest.mark.parametrize("augment_on", ["workers", "device"])
def test_slices_join_into_the_batch_a_whole_batch_worker_makes(tmp_path: Path, augment_on: str) -> None:
    folder = _folder(tmp_path / "images")
    common = ("data.num_workers=2", f"data.augment_on={augment_on}", "dataset.val_fraction=0.25")
    whole, whole_args = _epoch(tmp_path / "a", folder, *common, "data.worker_batch_size=16")
    sliced, sliced_args = _epoch(tmp_path / "b", folder, *common, "data.worker_batch_size=4")
    assert (whole_args["worker_batch_size"], sliced_args["worker_batch_size"]) == (16, 4)
    assert len(whole) == len(sliced) == 36 // 16  # drop_last: whole steps only, never a group of slices short
    for one, four in zip(whole, sliced, strict=True):
        expected, joined = (b.images.to(CPU) for b in (one, four))
        if augment_on == "device":  # the joined canvas is padded to its largest slice: compare the crops
            expected, joined = expected.resampled(), joined.resampled()
        assert torch.equal(expected, joined) and torch.equal(one.labels, four.labels)
        assert one.sources == four.sources
        assert four.times.samples == 16 and four.times.finished > 0


def test_by_default_a_worker_makes_a_whole_batch(tmp_path: Path) -> None:
    """null: whole batches (2 workers on 2 cores ran slices of 16 at 0.97-0.98x whole batches of 64)."""
    batches, args = _epoch(tmp_path / "a", _folder(tmp_path / "images"), "data.num_workers=2")
    assert args["worker_batch_size"] == 16 and isinstance(batches[0].images, torch.Tensor)


def test_a_worker_batch_size_that_does_not_divide_the_batch_is_one_line(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"data.worker_batch_size=5 is invalid: expected a divisor of data.batch_si"):
        validate(compose_cfg("data.batch_size=16", "data.worker_batch_size=5", output_dir=str(tmp_path)))
    with pytest.raises(ConfigError, match=r"data.worker_batch_size=0 is invalid"):
        validate(compose_cfg("data.worker_batch_size=0", output_dir=str(tmp_path)))


def test_raw_slices_keep_each_plan_at_its_image_s_top_left() -> None:
    """data.augment_on=device: canvases of different sizes are padded to the largest; the crops do not change."""
    generator = torch.Generator().manual_seed(0)
    plan = torch.tensor([[0.0, 0.0, 6.0, 8.0, 0.0, 1.0, 0.0, 0.0, 1.0, 6.0, 8.0]] * 2)
    small = RawBatch(torch.randint(0, 256, (2, 3, 6, 8), dtype=torch.uint8, generator=generator), plan, 4)
    large = RawBatch(torch.randint(0, 256, (2, 3, 9, 5), dtype=torch.uint8, generator=generator), plan, 4)
    joined = slices.join_raw([small, large])
    assert joined.images.shape == (4, 3, 9, 8) and joined.plan.shape == (4, 11)
    assert torch.equal(joined.images[:2, :, :6, :8], small.images) and int(joined.images[:2, :, 6:].sum()) == 0
    assert torch.equal(joined.resampled(), torch.cat([small.resampled(), large.resampled()]))


def test_undecoded_slices_join_with_their_orientations_and_times() -> None:
    files = [torch.arange(n, dtype=torch.uint8) for n in (3, 5, 2)]
    first = EncodedBatch.pack(files[:2], [7, 8])
    second = EncodedBatch.pack(files[2:], [9], orientations=[6])
    joined = slices.join_encoded([first, second])
    assert [f.tolist() for f in joined.files()] == [f.tolist() for f in files]
    assert joined.seeds.tolist() == [7, 8, 9] and joined.orientations.tolist() == [1, 1, 6]
    times = slices.join_times(
        [BatchTimes(read=1.0, samples=2, finished=5.0), BatchTimes(read=2.0, samples=1, finished=4.0)]
    )
    assert times == BatchTimes(read=3.0, samples=3, finished=5.0)
    assert slices.join_times([BatchTimes(read=1.0), ()]) == ()
