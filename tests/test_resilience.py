"""Never lose a run: preemption and exact resume, damaged checkpoints, NaN losses and unreadable images.

Every test drives `train.py` as a real subprocess, as a user or a scheduler would.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import FAST, RESUMABLE, interrupt, read_metrics, run_train
from PIL import Image
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

TESTS_DIR = str(Path(__file__).parent)


def _steps(run_dir: Path, tag: str) -> list[tuple[int, float]]:
    events = EventAccumulator(str(run_dir / "tb"))  # applies TensorBoard's purge of orphaned events
    events.Reload()
    return [(e.step, e.value) for e in events.Scalars(tag)]


def _ckpt(path: Path) -> dict:
    return torch.load(path, map_location="cpu", weights_only=True)


def test_sigterm_saves_and_the_resumed_run_matches_an_uninterrupted_one(tmp_path: Path, data_dir: Path) -> None:
    straight = tmp_path / "straight"
    assert run_train(RESUMABLE, straight, data_dir).returncode == 0

    run_dir = tmp_path / "interrupted"
    stderr = interrupt(RESUMABLE, run_dir, data_dir)
    assert "stopped: SIGTERM at step" in stderr and "Traceback" not in stderr
    stopped = _ckpt(run_dir / "checkpoints" / "last.pt")["progress"]
    assert 3 <= stopped["step"] < 16 and not (run_dir / "metrics.json").exists()

    resumed = run_train(RESUMABLE, run_dir, data_dir)  # the same command in the same run directory
    assert resumed.returncode == 0, resumed.stderr
    assert f"resuming from {run_dir / 'checkpoints' / 'last.pt'}: step {stopped['step']}" in resumed.stdout

    a, b = _ckpt(straight / "checkpoints" / "last.pt"), _ckpt(run_dir / "checkpoints" / "last.pt")
    assert a["progress"]["step"] == b["progress"]["step"] == 16
    for key, tensor in a["model"].items():
        assert torch.equal(tensor, b["model"][key]), key  # bit-identical weights and BatchNorm statistics
    for key, state in a["optimizer"]["state"].items():
        assert all(torch.equal(v, b["optimizer"]["state"][key][k]) for k, v in state.items())
    assert read_metrics(straight)["val_loss"] == read_metrics(run_dir)["val_loss"]
    # One TensorBoard run, every logging step exactly once.
    logged = [step for step, _ in _steps(run_dir, "train/loss")]
    assert logged == [step for step, _ in _steps(straight, "train/loss")] == list(range(2, 17, 2))
    assert _steps(run_dir, "val/acc") == _steps(straight, "val/acc")


def test_a_damaged_last_checkpoint_falls_back_to_the_previous_one(tmp_path: Path, data_dir: Path) -> None:
    run_dir = tmp_path / "run"
    assert run_train(RESUMABLE, run_dir, data_dir).returncode == 0
    last, prev = run_dir / "checkpoints" / "last.pt", run_dir / "checkpoints" / "last.prev.pt"
    prev_step = _ckpt(prev)["progress"]["step"]
    last.write_bytes(last.read_bytes()[: last.stat().st_size // 2])  # a copy cut short

    more = run_train([*RESUMABLE, "trainer.epochs=3"], run_dir, data_dir)
    assert more.returncode == 0, more.stderr
    assert f"checkpoint {last} is damaged" in more.stdout
    assert f"resuming from {prev}: step {prev_step}" in more.stdout
    assert read_metrics(run_dir)["steps"] == 24
    # The damaged file was never rotated over the good one: last.prev.pt is a verified checkpoint.
    assert _ckpt(prev)["progress"]["step"] > prev_step


def test_resume_from_an_explicit_checkpoint(tmp_path: Path, data_dir: Path) -> None:
    first = tmp_path / "first"
    assert run_train(RESUMABLE, first, data_dir).returncode == 0
    source = first / "checkpoints" / "last.pt"
    result = run_train([*RESUMABLE, "trainer.epochs=3", f"trainer.resume={source}"], tmp_path / "second", data_dir)
    assert result.returncode == 0, result.stderr
    assert f"resuming from {source}: step 16" in result.stdout
    assert [s for s, _ in _steps(tmp_path / "second", "val/acc")] == [24]


@pytest.mark.parametrize("policy", ["skip", "stop"])
def test_nonfinite_loss(policy: str, tmp_path: Path, data_dir: Path) -> None:
    run_dir = tmp_path / "run"
    args = [*FAST, "model._target_=faults.build_nan_model", "trainer.ckpt_every_n_steps=2"]
    env = {"PYTHONPATH": TESTS_DIR, "IMGTRAIN_FAULT_NAN_CALLS": "3,4"}
    result = run_train([*args, f"trainer.nonfinite={policy}"], run_dir, data_dir, **env)
    if policy == "skip":
        assert result.returncode == 0, result.stderr
        metrics = read_metrics(run_dir)
        assert metrics["nonfinite_steps"] == 2 and metrics["steps"] == 8
        assert "non-finite loss at step 3: step skipped" in result.stdout
        weights = _ckpt(run_dir / "checkpoints" / "last.pt")["model"]
        assert all(torch.isfinite(t).all() for t in weights.values() if t.is_floating_point())
    else:
        assert result.returncode == 1
        errors = [line for line in result.stderr.splitlines() if line.strip()]
        assert len(errors) == 1 and errors[0].startswith("error: the training loss is NaN or infinite at step 3")
        assert f"The last good checkpoint is {run_dir / 'checkpoints' / 'last.pt'}" in errors[0]
        assert _ckpt(run_dir / "checkpoints" / "last.pt")["progress"]["step"] == 2  # kept, not overwritten
        assert not (run_dir / "metrics.json").exists() and (run_dir / "failed.json").exists()


def _image_folder(root: Path, per_class: int = 12) -> list[Path]:
    """root/{train,val}/<class>/*.png with 3 classes; returns the train files."""
    rng = np.random.default_rng(0)
    files = []
    for split, count in (("train", per_class), ("val", 4)):
        for c in range(3):
            folder = root / split / f"class{c}"
            folder.mkdir(parents=True)
            for i in range(count):
                pixels = (rng.random((40, 40, 3)) * 80 + 60 * c).astype(np.uint8)
                path = folder / f"{i:03d}.png"
                Image.fromarray(pixels).save(path)
                files.append(path) if split == "train" else None
    return files


@pytest.mark.parametrize("budget", [10, 1])
def test_unreadable_images_are_skipped_counted_and_budgeted(budget: int, tmp_path: Path, data_dir: Path) -> None:
    files = _image_folder(tmp_path / "images")
    truncated, garbage = files[5], files[20]
    truncated.write_bytes(truncated.read_bytes()[:60])
    garbage.write_bytes(b"not an image at all" * 10)
    args = [
        "dataset=imagefolder",
        f"dataset.root={tmp_path / 'images'}",
        "dataset.image_size=32",
        "data.batch_size=6",
        "data.num_workers=1",
        "trainer.epochs=2",
        "trainer.log_every_n_steps=2",
        "trainer.warmup_steps=0",
        f"data.max_bad_samples={budget}",
    ]
    run_dir = tmp_path / "run"
    result = run_train(args, run_dir, data_dir)
    output = result.stdout + result.stderr
    assert f"skipped an unreadable image: {truncated}" in output
    assert f"skipped an unreadable image: {garbage}" in output or budget == 1
    if budget == 10:
        assert result.returncode == 0, result.stderr
        assert read_metrics(run_dir)["skipped_samples"] == 4  # two files, read once per epoch
        assert _steps(run_dir, "data/skipped_samples")[-1][1] == 4
    else:
        assert result.returncode == 1
        errors = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
        assert len(errors) == 1 and "data.max_bad_samples=1 exceeded: 2 image reads failed" in errors[0]
        assert (run_dir / "checkpoints" / "last.pt").exists()  # the work so far is saved at the boundary
        assert not (run_dir / "metrics.json").exists()


def test_a_checkpoint_from_another_model_is_a_clear_error(tmp_path: Path, data_dir: Path) -> None:
    run_dir = tmp_path / "run"
    assert run_train([*FAST, "trainer.max_steps=2"], run_dir, data_dir).returncode == 0
    other = run_train([*FAST, "trainer.max_steps=2", "model=resnet34"], run_dir, data_dir)
    assert other.returncode == 1 and "Traceback" not in other.stderr
    assert "does not fit this run's model or optimizer" in other.stderr and "trainer.resume=none" in other.stderr


def test_rerunning_a_finished_run_keeps_its_results(tmp_path: Path, data_dir: Path) -> None:
    run_dir = tmp_path / "run"
    assert run_train([*FAST, "trainer.max_steps=4"], run_dir, data_dir).returncode == 0
    before = (run_dir / "metrics.json").read_text()
    again = run_train([*FAST, "trainer.max_steps=4"], run_dir, data_dir)
    assert again.returncode == 0 and "this run already finished at step 4" in again.stdout
    assert (run_dir / "metrics.json").read_text() == before


def test_device_resident_training_resumes_exactly(tmp_path: Path, data_dir: Path) -> None:
    args = [*RESUMABLE, "data.device_resident=true"]
    straight = tmp_path / "straight"
    assert run_train(args, straight, data_dir).returncode == 0
    part = tmp_path / "part"
    interrupt(args, part, data_dir)
    resumed = run_train(args, part, data_dir)
    assert resumed.returncode == 0 and "resuming from" in resumed.stdout
    a, b = _ckpt(straight / "checkpoints" / "last.pt"), _ckpt(part / "checkpoints" / "last.pt")
    assert all(torch.equal(t, b["model"][k]) for k, t in a["model"].items())
