"""A resumed run trains by the settings it is given: its LR schedule, positioned by the samples already seen, and
its optimiser's hyperparameters come from its own config; only the optimiser's moments come from the checkpoint
(issue 38). Runs are in-process and tiny: 64 images in 4 steps of 16 per epoch, a 3-layer model."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch
from helpers import compose_cfg, read_metrics
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from torch import nn
from torch.optim.lr_scheduler import LRScheduler, OneCycleLR

from imgtrain.train.run import run


def tiny_cnn(num_classes: int, **_: object) -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, stride=2, padding=1),
        nn.BatchNorm2d(8),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(8, num_classes),
    )


def one_cycle(optimizer, *, steps_per_epoch: int, total_steps: int, warmup_epochs: float) -> LRScheduler:
    """A schedule of a fork's own: torch's one-cycle policy, its rise over `warmup_epochs`; it also cycles AdamW's
    first beta, a hyperparameter the schedule sets."""
    rise = max(0.05, warmup_epochs * steps_per_epoch / total_steps)
    return OneCycleLR(optimizer, [g["lr"] for g in optimizer.param_groups], total_steps=total_steps, pct_start=rise)


TINY = [
    "model._target_=test_resume_settings.tiny_cnn",
    "dataset=synthetic",
    "dataset.image_size=32",
    "dataset.num_train=64",
    "dataset.num_val=16",
    "dataset.num_classes=4",
    "data.batch_size=16",
    "data.num_workers=0",
    "system.deterministic=true",
    "metrics.skip_first_steps=0",
    "metrics.log_every_n_steps=1",  # the LR of every step in TensorBoard
    "metrics.compute_probe=false",
]
SCHEDULES = {
    "warmup_cosine": ["schedule=warmup_cosine", "schedule.warmup_epochs=0.5"],
    "step": ["schedule=step", "schedule.warmup_epochs=0.5", "schedule.step_epochs=1", "schedule.gamma=0.5"],
    "fork's own": ["schedule._target_=test_resume_settings.one_cycle", "schedule.warmup_epochs=0.5"],
}


def _train(run_dir: Path, *overrides: str) -> dict:
    run(compose_cfg(*TINY, *overrides, output_dir=str(run_dir)))
    return read_metrics(run_dir)


def _lr(run_dir: Path) -> dict[int, float]:
    """TensorBoard's `lr` by step: the LR after each optimizer step, as the real reader sees it, each run's event
    file read in the order the runs wrote them. (Read as a folder, the files go in name order: two in-process runs
    in the same second are named by a process-wide counter, and "...123.10" sorts before "...123.9"; the reader
    then takes the first run's steps 1-4 as a restart and drops the resumed run's 5-8.)"""
    steps: dict[int, float] = {}
    for path in sorted((run_dir / "tb").glob("events.out.tfevents.*"), key=lambda path: path.stat().st_mtime_ns):
        events = EventAccumulator(str(path))
        events.Reload()
        if "lr" in events.Tags()["scalars"]:
            steps.update({event.step: event.value for event in events.Scalars("lr")})
    return steps


def _checkpoint(run_dir: Path) -> dict:
    return torch.load(run_dir / "checkpoints" / "last.pt", weights_only=True)


@pytest.mark.slow  # slow: the fast suite's budget (make test <= 120 s on 2 cores); CI runs it in make test-slow
@pytest.mark.parametrize("schedule", SCHEDULES)
def test_a_run_resumed_with_more_epochs_follows_the_schedule_of_its_own_length(
    schedule: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    _train(straight, *SCHEDULES[schedule], "train.epochs=3")
    _train(resumed, *SCHEDULES[schedule], "train.epochs=1")
    caplog.set_level(logging.INFO)
    assert _train(resumed, *SCHEDULES[schedule], "train.epochs=3")["steps"] == 12
    expected, got = _lr(straight), _lr(resumed)
    assert len(expected) == 12 and {step: got[step] for step in range(5, 13)} == {s: expected[s] for s in range(5, 13)}
    assert len(set(expected.values())) >= 3  # the schedule moves: equal series are not two constants
    assert "resuming with settings other than the checkpoint's (train.epochs 1 -> 3)" in caplog.text
    assert "step 4 of this run's 12-step schedule" in caplog.text


def test_a_batch_change_lands_at_the_same_point_of_training(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """1 epoch at batch 16 (4 steps), then 3 epochs at batch 32: two more epochs of 2 steps, with the LR an
    uninterrupted 3-epoch run at batch 32 has from its epoch 2 on."""
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    cosine = SCHEDULES["warmup_cosine"]
    _train(straight, *cosine, "train.epochs=3", "data.batch_size=32")
    _train(resumed, *cosine, "train.epochs=1")
    caplog.set_level(logging.INFO)
    summary = _train(resumed, *cosine, "train.epochs=3", "data.batch_size=32")
    assert summary["steps"] == 4 + 4  # the epochs asked for, not the checkpoint's step count in the new batch
    expected, got = _lr(straight), _lr(resumed)
    assert [got[step] for step in range(5, 9)] == [expected[step] for step in range(3, 7)]
    assert "(global batch 16 -> 32, train.epochs 1 -> 3)" in caplog.text
    assert "from where training was (epoch 2, sample 0: step 2 of this run's 6-step schedule)" in caplog.text


def test_the_hyperparameters_come_from_the_config_and_the_moments_from_the_checkpoint(tmp_path: Path) -> None:
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    changed = ["optim.lr=0.004", "optim.weight_decay=0.01", "optim.betas=[0.8,0.99]"]
    _train(straight, "train.epochs=2", *changed)
    _train(resumed, "train.epochs=1")
    _train(resumed, "train.epochs=2", *changed)
    assert [_lr(resumed)[step] for step in range(5, 9)] == [_lr(straight)[step] for step in range(5, 9)]
    groups = _checkpoint(resumed)["optimizer"]["param_groups"]
    assert [g["weight_decay"] for g in groups] == [0.01, 0.0] and all(g["betas"] == (0.8, 0.99) for g in groups)
    state = _checkpoint(resumed)["optimizer"]["state"]
    assert all(int(buffers["step"]) == 8 for buffers in state.values())  # AdamW's count went on from step 4


@pytest.mark.parametrize("named", [True, False], ids=["class named", "older checkpoint: by its keys"])
def test_another_optimizer_starts_fresh_and_says_so_in_one_line(
    named: bool, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    run_dir = tmp_path / "run"
    _train(run_dir, "train.epochs=1")  # AdamW, the default
    if not named:  # as written before checkpoints named the optimizer's class
        payload = _checkpoint(run_dir)
        del payload["optimizer_class"]
        torch.save(payload, run_dir / "checkpoints" / "last.pt")
    caplog.set_level(logging.INFO)
    assert _train(run_dir, "train.epochs=2", "optim=sgd")["steps"] == 8
    said = [r.getMessage() for r in caplog.records if r.getMessage().startswith("resuming with settings other")]
    saved = "AdamW" if named else "another optimizer (its param groups have other keys)"
    assert len(said) == 1 and f"the checkpoint's optimizer is {saved}, this run's SGD: SGD starts with fresh" in said[0]
    assert "optim._target_ AdamW -> SGD" in said[0] and "\n" not in said[0]
    assert all("momentum_buffer" in buffers for buffers in _checkpoint(run_dir)["optimizer"]["state"].values())


def test_the_same_settings_resume_without_a_word_and_a_longer_run_says_what_it_changed(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    run_dir = tmp_path / "run"
    _train(run_dir, "train.epochs=2", "train.max_steps=5")
    caplog.set_level(logging.INFO)
    _train(run_dir, "train.epochs=2", "train.max_steps=5")
    assert f"resuming from {run_dir / 'checkpoints' / 'last.pt'}: step 5" in caplog.text
    assert "this run already finished at step 5" in caplog.text and "resuming with settings other" not in caplog.text
    (run_dir / "metrics.json").unlink()  # a longer run in the same directory
    caplog.clear()
    assert _train(run_dir, "train.epochs=2")["steps"] == 8
    assert "resuming with settings other than the checkpoint's (train.max_steps 5 -> None)" in caplog.text
