"""Learning on real images that ship offline: scikit-learn's digits, written out as an ImageFolder."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from helpers import read_metrics, run_train
from PIL import Image

load_digits = pytest.importorskip("sklearn.datasets", reason="needs scikit-learn (the dev extra)").load_digits

MIN_ACCURACY = 0.85  # chance is 0.10


@pytest.fixture(scope="module")
def digits_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """1,797 8x8 digits, upscaled to 32 px PNGs in root/<digit>/<index>.png (no val/: the split is ours)."""
    root = tmp_path_factory.mktemp("digits")
    digits = load_digits()
    for index, (image, label) in enumerate(zip(digits.images, digits.target, strict=True)):
        pixels = (image * (255.0 / 16.0)).astype(np.uint8)  # digits are 0..16 intensities
        folder = root / str(label)
        folder.mkdir(exist_ok=True)
        Image.fromarray(pixels, mode="L").resize((32, 32), Image.BILINEAR).save(folder / f"{index}.png")
    return root


@pytest.mark.slow  # a real training to a target accuracy: about a minute
def test_resnet_learns_digits_through_imagefolder(digits_root: Path, tmp_path: Path, data_dir: Path) -> None:
    run_dir = tmp_path / "run"
    args = [
        "dataset=imagefolder",
        f"dataset.root={digits_root}",
        "dataset.image_size=32",
        "dataset.val_resize=32",
        "dataset.val_fraction=0.2",
        "dataset.augment=none",  # flips would turn some digits into others
        "model=resnet18",
        "optim=adamw",
        "data.batch_size=64",
        "data.num_workers=1",
        "train.epochs=4",
        "metrics.log_every_n_steps=10",
    ]
    result = run_train(args, run_dir, data_dir, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    metrics = read_metrics(run_dir)
    assert metrics["dataset"] == "imagefolder"
    # 20% of each class's 174-183 images (rounded per class), each validation image counted once.
    assert 350 <= metrics["val_count"] <= 370
    assert metrics["val_acc"] >= MIN_ACCURACY, metrics["val_acc"]
