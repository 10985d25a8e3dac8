"""The README's "Where to change what" table, kept true: each example is a patch in docs/fork-examples/ that a fork
would make. Applied to a copy of the repository's code (src/, conf/, train.py), each must apply cleanly (checked in
`make test`) and train for a few steps with the command the table gives (`make test-slow`: a train.py process each).
"""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
from helpers import ROOT
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

EXAMPLES_DIR = ROOT / "docs" / "fork-examples"
COPIED = ("src", "conf", "train.py")  # what a run needs; the patches touch nothing else


def _copy_code(destination: Path) -> Path:
    """The tracked files of src/, conf/ and train.py (a fresh clone's), copied to `destination`."""
    listed = subprocess.run(["git", "ls-files", *COPIED], cwd=ROOT, capture_output=True, text=True, check=True)
    for name in listed.stdout.split():
        (destination / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / name, destination / name)
    return destination


def _apply(patch: str, copy: Path, check_only: bool = False) -> subprocess.CompletedProcess:
    command = ["git", "apply", *(["--check"] if check_only else []), str(EXAMPLES_DIR / f"{patch}.patch")]
    return subprocess.run(command, cwd=copy, capture_output=True, text=True)


def _train(copy: Path, data_dir: Path, *overrides: str, run: str = "run") -> subprocess.CompletedProcess:
    """`python train.py debug=fast train.max_steps=8 <overrides>` in the patched copy, its own src/ first."""
    env = {**os.environ, "PYTHONPATH": str(copy / "src"), "IMGTRAIN_DATA_DIR": str(data_dir)}
    command = [sys.executable, "train.py", "debug=fast", "train.max_steps=8", *overrides, f"hydra.run.dir={run}"]
    return subprocess.run(command, cwd=copy, env=env, capture_output=True, text=True, timeout=300)


def _python(copy: Path, code: str) -> None:
    env = {**os.environ, "PYTHONPATH": str(copy / "src")}
    result = subprocess.run([sys.executable, "-c", code], cwd=copy, env=env, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-2000:]


def _scalars(run: Path, tag: str) -> list[tuple[int, float]]:
    events = EventAccumulator(str(run / "tb"))
    events.Reload()
    return [(e.step, e.value) for e in events.Scalars(tag)]


def _model(copy: Path, out: str, metrics: dict) -> None:
    assert "model: build_tiny_cnn, 0.1M parameters" in out


def _dataset(copy: Path, out: str, metrics: dict) -> None:
    assert "dataset noise: 2048 train / 256 val images, 4 classes, 32 px" in out and metrics["val_count"] == 256


def _augment(copy: Path, out: str, metrics: dict) -> None:
    _python(
        copy, "from imgtrain.data.datasets import train_transform; assert 'ColorJitter' in str(train_transform(32))"
    )
    assert metrics["pipeline"]["stage_ms_per_image"]["augment"] > 0  # the per-sample jitter: the augment stage


def _loss(copy: Path, out: str, metrics: dict) -> None:
    # With gamma=0 the focal loss is cross-entropy; with gamma=2 it is smaller, each example weighted by (1-p)^2.
    _python(
        copy,
        "import torch, torch.nn.functional as F; from imgtrain.train.step import focal_loss; "
        "x, y = torch.randn(16, 10), torch.randint(0, 10, (16,)); ce = F.cross_entropy(x, y); "
        "assert torch.allclose(focal_loss(x, y, 0.0), ce) and focal_loss(x, y) < ce",
    )


def _optim(copy: Path, out: str, metrics: dict) -> None:
    lr = dict(_scalars(copy / "run", "lr"))
    # 8 steps, 4 of warmup, then x0.1 every step: two drops from step 4 to 6 (cosine would halve it).
    assert math.isclose(lr[6] / lr[4], 0.01, rel_tol=1e-3), lr


def _metric(copy: Path, out: str, metrics: dict) -> None:
    assert metrics["val_acc"] <= metrics["val_acc5"] <= 1.0 and "val acc (top-5)" in out
    assert [step for step, _ in _scalars(copy / "run", "val/acc5")] == [8]


def _group(copy: Path, out: str, metrics: dict) -> None:
    refused = _train(copy, copy, "train.grad_clip_norm=-1", run="refused")
    assert refused.returncode == 2
    assert (
        refused.stderr.strip()
        == "error: train.grad_clip_norm=-1.0 is invalid: expected null (no clipping) or a number >= 0"
    )


EXAMPLES: dict[str, tuple[list[str], Callable[[Path, str, dict], None]]] = {  # patch: (overrides, its check)
    "model": (["model=tiny_cnn"], _model),
    "dataset": (["dataset=noise"], _dataset),
    "augment": ([], _augment),
    "loss": ([], _loss),
    "optim": ([], _optim),
    "metric": ([], _metric),
    "group": (["train.grad_clip_norm=0.5"], _group),
}


def test_every_example_is_tested_and_applies_to_the_code_as_it_is(tmp_path: Path) -> None:
    assert sorted(p.stem for p in EXAMPLES_DIR.glob("*.patch")) == sorted(EXAMPLES)
    copy = _copy_code(tmp_path)
    for patch in EXAMPLES:
        result = _apply(patch, copy, check_only=True)
        assert result.returncode == 0, f"docs/fork-examples/{patch}.patch no longer applies: {result.stderr}"


def test_the_readme_table_links_every_example() -> None:
    readme = (ROOT / "README.md").read_text()
    assert all(f"docs/fork-examples/{patch}.patch" in readme for patch in EXAMPLES)


@pytest.mark.slow  # a train.py process per example: about 5 s each on 2 cores
@pytest.mark.parametrize("patch", EXAMPLES)
def test_a_fork_example_trains(patch: str, tmp_path: Path, data_dir: Path) -> None:
    overrides, check = EXAMPLES[patch]
    copy = _copy_code(tmp_path / "fork")
    applied = _apply(patch, copy)
    assert applied.returncode == 0, applied.stderr
    result = _train(copy, data_dir, *overrides)
    assert result.returncode == 0, result.stderr[-3000:]
    metrics = json.loads((copy / "run" / "metrics.json").read_text())
    assert metrics["status"] == "ok" and metrics["steps"] == 8
    check(copy, result.stdout + (copy / "run" / "train.log").read_text(), metrics)
