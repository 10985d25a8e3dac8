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
import torch
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
    # A fork's model file without a `name`: the log and metrics.json name it by its builder
    assert "model: build_tiny_cnn, 94.8k parameters" in out and metrics["model"] == "build_tiny_cnn"


def _dataset(copy: Path, out: str, metrics: dict) -> None:
    assert "dataset noise: 2048 train / 256 val images, 4 classes, 32 px" in out and metrics["val_count"] == 256
    assert metrics["dataset"] == "noise" and metrics["val_acc"] > 0.5  # 4 colours, chance 0.25: 0.91 after 8 steps


def _augment(copy: Path, out: str, metrics: dict) -> None:
    # The jitter runs per sample after the crop and flip, which stay batched: spec_of still finds them
    _python(
        copy,
        "from imgtrain.data.batched import spec_of; from imgtrain.data.datasets import train_transform; "
        "spec = spec_of(train_transform(32)); assert [type(step).__name__ for step in spec.policy] == ['ColorJitter']",
    )
    assert metrics["pipeline"]["stage_ms_per_image"]["augment"] > 0  # the per-sample jitter: the augment stage


def _loss(copy: Path, out: str, metrics: dict) -> None:
    # Poly-1 is cross-entropy at epsilon=0, and cross-entropy + epsilon x mean(1 - p_target) otherwise, for class
    # indices and for mixup's probabilities alike (a one-hot row is its index)
    _python(
        copy,
        "import torch, torch.nn.functional as F; from imgtrain.train.losses import Poly1Loss; "
        "x, y = torch.randn(16, 10), torch.randint(0, 10, (16,)); soft = torch.randn(16, 10).softmax(1); "
        "p = x.softmax(1); ce, ce_soft = F.cross_entropy(x, y), F.cross_entropy(x, soft); "
        "assert torch.allclose(Poly1Loss(0.0)(x, y), ce) and torch.allclose(Poly1Loss(0.0)(x, soft), ce_soft); "
        "assert torch.allclose(Poly1Loss(2.0)(x, y), ce + 2 * (1 - p[torch.arange(16), y]).mean()); "
        "assert torch.allclose(Poly1Loss(2.0)(x, soft), ce_soft + 2 * (1 - (soft * p).sum(1)).mean()); "
        "assert torch.allclose(Poly1Loss()(x, F.one_hot(y, 10).float()), Poly1Loss()(x, y))",
    )
    assert "_target_: imgtrain.train.losses.Poly1Loss" in (copy / "run" / ".hydra" / "config.yaml").read_text()


def _optim(copy: Path, out: str, metrics: dict) -> None:
    # The "lr" tag at step s is the LR of step s + 1. 8 steps, 4 of warm-up (schedule.warmup_epochs=0.5 of 8):
    # base x (s + 1) / 4, then base x (1 - (s - 4) / 4)^2 (power 2, conf/schedule/poly.yaml); cosine: base / 2 at 6
    lr, base = dict(_scalars(copy / "run", "lr")), 1e-3  # conf/optim/rmsprop.yaml's lr
    expected = {2: base * 3 / 4, 4: base, 6: base * 0.25, 8: 0.0}
    assert lr.keys() == expected.keys(), lr
    assert all(math.isclose(lr[s], value, rel_tol=1e-6, abs_tol=1e-12) for s, value in expected.items()), lr
    state = torch.load(copy / "run" / "checkpoints" / "last.pt", weights_only=True)["optimizer"]
    assert "square_avg" in state["state"][0] and state["param_groups"][0]["alpha"] == 0.9  # RMSprop's own


def _metric(copy: Path, out: str, metrics: dict) -> None:
    assert metrics["val_acc"] <= metrics["val_acc3"] <= metrics["val_acc5"] and "val acc (top-3)" in out
    assert _scalars(copy / "run", "val/acc3") == [(8, pytest.approx(metrics["val_acc3"]))]


# train.grad_clip_norm=0.5 with SGD at lr 1 (no momentum, decay or warm-up): one update is minus the clipped
# gradient, of norm 0.5 however large the gradient
CLIPPED_STEP = """
import os
import torch
from hydra import compose, initialize_config_dir
from imgtrain.config.system import Precision
from imgtrain.config.validate import validate
from imgtrain.train.cli import register
from imgtrain.train.step import build_step
register()
keys = ["optim=sgd", "optim.lr=1", "optim.momentum=0", "optim.nesterov=false", "optim.weight_decay=0"]
with initialize_config_dir(version_base="1.3", config_dir=os.path.abspath("conf")):
    cfg = compose("config", [*keys, "schedule.warmup_epochs=0", "train.grad_clip_norm=0.5", "output_dir=unused"])
model = torch.nn.Linear(4, 3)
step = build_step(validate(cfg), model, torch.device("cpu"), Precision.fp32, (1, 1))
before = torch.cat([p.detach().flatten() for p in model.parameters()])
step.update(100 * model(torch.randn(8, 4)).square().sum())
moved = torch.cat([p.detach().flatten() for p in model.parameters()]) - before
assert abs(moved.norm().item() - 0.5) < 1e-4, moved.norm()
"""


def _group(copy: Path, out: str, metrics: dict) -> None:
    refused = _train(copy, copy, "train.grad_clip_norm=-1", run="refused")
    assert refused.returncode == 2
    assert (
        refused.stderr.strip()
        == "error: train.grad_clip_norm=-1.0 is invalid: expected null (no clipping) or a number >= 0"
    )
    _python(copy, CLIPPED_STEP)


EXAMPLES: dict[str, tuple[list[str], Callable[[Path, str, dict], None]]] = {  # patch: (overrides, its check)
    "model": (["model=tiny_cnn"], _model),
    "dataset": (["dataset=noise"], _dataset),
    "augment": ([], _augment),
    "loss": (["loss=poly1"], _loss),
    "optim": (["optim=rmsprop", "schedule=poly"], _optim),
    "metric": ([], _metric),
    "group": (["train.grad_clip_norm=0.5"], _group),
}


def test_every_example_is_tested_and_applies_to_the_code_as_it_is(tmp_path: Path) -> None:
    assert sorted(p.stem for p in EXAMPLES_DIR.glob("*.patch")) == sorted(EXAMPLES)
    copy = _copy_code(tmp_path)
    for patch in EXAMPLES:
        result = _apply(patch, copy, check_only=True)
        assert result.returncode == 0, f"docs/fork-examples/{patch}.patch no longer applies: {result.stderr}"


def test_the_readme_table_links_every_example_with_the_overrides_its_test_trains_with() -> None:
    rows = {line.split("docs/fork-examples/", 1)[1].split(".patch", 1)[0]: line for line in _table_rows()}
    assert sorted(rows) == sorted(EXAMPLES)
    for patch, (overrides, _) in EXAMPLES.items():
        command = f"`{' '.join(overrides)}`"
        assert not overrides or command in rows[patch], f"README's {patch} row should say {command}"


def _table_rows() -> list[str]:
    """The rows of the README's "Where to change what" table that link an example."""
    section = (ROOT / "README.md").read_text().split("## Where to change what", 1)[1].split("\n## ", 1)[0]
    return [line for line in section.splitlines() if line.startswith("| ") and "docs/fork-examples/" in line]


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
