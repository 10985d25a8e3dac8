"""Never lose a run: preemption and exact resume, damaged checkpoints, NaN losses and unreadable images.

Runs happen in the test process (`run(cfg)`), except where the process is the point: a SIGTERM to a real
`train.py` and its process group, and the exit status and stderr line of a failed run. The uninterrupted
baseline that several tests compare against is trained once per session.
"""

from __future__ import annotations

import errno
import logging
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import psutil
import pytest
import torch
from helpers import FAST, RESUMABLE, ROOT, _env, _wait_for, compose_cfg, interrupt, read_metrics, run_train
from PIL import Image
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from imgtrain.common.errors import RunError
from imgtrain.resilience import checkpoint
from imgtrain.resilience.checkpoint import Checkpointer
from imgtrain.resilience.faults import Preempted
from imgtrain.train.run import run


def _train(run_dir: Path, *overrides: str) -> dict:
    """`python train.py <overrides>` in this process, its run directory pinned to `run_dir`."""
    run(compose_cfg(*overrides, output_dir=str(run_dir)))
    return read_metrics(run_dir)


def _steps(run_dir: Path, tag: str) -> list[tuple[int, float]]:
    events = EventAccumulator(str(run_dir / "tb"))  # applies TensorBoard's purge of orphaned events
    events.Reload()
    return [(e.step, e.value) for e in events.Scalars(tag)]


def _ckpt(path: Path) -> dict:
    return torch.load(path, map_location="cpu", weights_only=True)


def _same_weights(a: Path, b: Path) -> None:
    first, second = _ckpt(a / "checkpoints" / "last.pt"), _ckpt(b / "checkpoints" / "last.pt")
    assert first["progress"]["step"] == second["progress"]["step"]
    for key, tensor in first["model"].items():
        assert torch.equal(tensor, second["model"][key]), key  # bit-identical weights and BatchNorm statistics
    for key, state in first["optimizer"]["state"].items():
        assert all(torch.equal(v, second["optimizer"]["state"][key][k]) for k, v in state.items())


@pytest.fixture(scope="session")
def straight(tmp_path_factory: pytest.TempPathFactory, data_dir: Path) -> Path:
    """The uninterrupted RESUMABLE run (2 epochs of 8 steps, deterministic): read, never changed, by tests."""
    run_dir = tmp_path_factory.mktemp("straight") / "run"
    _train(run_dir, *RESUMABLE)
    return run_dir


@pytest.mark.slow  # about 35 s with its fixture: CI runs it in make test-slow
def test_sigterm_saves_and_the_resumed_run_matches_an_uninterrupted_one(
    straight: Path, tmp_path: Path, data_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    run_dir = tmp_path / "interrupted"
    stderr = interrupt(RESUMABLE, run_dir, data_dir)  # a real process and its worker, a real SIGTERM
    assert "stopped: SIGTERM at step" in stderr and "Traceback" not in stderr
    stopped = _ckpt(run_dir / "checkpoints" / "last.pt")["progress"]
    assert 3 <= stopped["step"] < 16 and not (run_dir / "metrics.json").exists()

    caplog.set_level(logging.INFO)
    resumed = _train(run_dir, *RESUMABLE)  # the same command in the same run directory
    assert f"resuming from {run_dir / 'checkpoints' / 'last.pt'}: step {stopped['step']}" in caplog.text
    assert resumed["steps"] == 16
    _same_weights(straight, run_dir)
    assert read_metrics(straight)["val_loss"] == resumed["val_loss"]
    # One TensorBoard run, every logging step exactly once.
    logged = [step for step, _ in _steps(run_dir, "train/loss")]
    assert logged == [step for step, _ in _steps(straight, "train/loss")] == list(range(2, 17, 2))
    assert _steps(run_dir, "val/acc") == _steps(straight, "val/acc")


@pytest.mark.slow  # a real process group and a real SIGINT, then a resumed run
def test_ctrl_c_saves_one_line_exit_130_and_the_same_command_resumes_exactly(
    straight: Path, tmp_path: Path, data_dir: Path
) -> None:
    """Ctrl-C reaches the training process and its DataLoader worker (the terminal signals the process group):
    the step where it stops is saved, the workers print nothing, and the resumed run is the uninterrupted one."""
    run_dir = tmp_path / "interrupted"
    stderr = interrupt(RESUMABLE, run_dir, data_dir, signal.SIGINT)
    assert "stopped: SIGINT at step" in stderr and "Ctrl-C again to exit at once" in stderr
    assert "Traceback" not in stderr and "KeyboardInterrupt" not in stderr
    stopped = _ckpt(run_dir / "checkpoints" / "last.pt")["progress"]
    assert 3 <= stopped["step"] < 16 and not (run_dir / "metrics.json").exists()
    assert _train(run_dir, *RESUMABLE)["steps"] == 16
    _same_weights(straight, run_dir)


@pytest.mark.slow  # a real worker killed with SIGKILL, as the OOM killer does, then a resumed run
def test_a_worker_killed_by_sigkill_ends_in_one_line_saved_and_the_same_command_resumes_exactly(
    straight: Path, tmp_path: Path, data_dir: Path
) -> None:
    run_dir = tmp_path / "run"
    cmd = [sys.executable, str(ROOT / "train.py"), *RESUMABLE, f"hydra.run.dir={run_dir}"]
    pipes = {"stdout": subprocess.PIPE, "stderr": subprocess.PIPE}
    proc = subprocess.Popen(cmd, cwd=ROOT, env=_env(data_dir), text=True, start_new_session=True, **pipes)
    _wait_for(run_dir / "checkpoints" / "last.pt", proc)  # step 3 of the first epoch: one (training) worker
    workers = [c for c in psutil.Process(proc.pid).children() if "train.py" in " ".join(c.cmdline())]
    started = time.monotonic()
    workers[0].kill()
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 1 and time.monotonic() - started < 20, stderr[-3000:]
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in stderr, stderr[-3000:]
    assert lines[0].startswith(f"error: DataLoader worker (pid(s) {workers[0].pid}) exited unexpectedly")
    assert "killed by signal: Killed" in lines[0] and "Memory peaks" in lines[0] and "/dev/shm" in lines[0]
    saved = _ckpt(run_dir / "checkpoints" / "last.pt")["progress"]["step"]
    assert f"(step {saved}). Run the same command again" in lines[0] and 3 <= saved < 16
    assert _train(run_dir, *RESUMABLE)["steps"] == 16
    _same_weights(straight, run_dir)


@pytest.mark.slow  # three runs each; the SIGTERM test above covers resume on the DataLoader path
@pytest.mark.parametrize("device_path", ["data.device_resident=true", "data.augment_on=device"])
def test_device_side_augmentation_resumes_exactly(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, device_path) -> None:
    """A SIGTERM to this process during step 5: saved when that step ends (mid-epoch), then continued in the
    same directory: the same weights as one uninterrupted run. Device-resident data, and batches cropped by
    the device from each sample's plan (data.augment_on=device; on the CPU here, the same code)."""
    args = [*RESUMABLE, device_path]
    _train(tmp_path / "straight", *args)
    real_step = Checkpointer.step

    def signal_after_step_5(self: Checkpointer) -> None:
        if self.progress.step == 5:
            os.kill(os.getpid(), signal.SIGTERM)  # recorded by the run's handler; one process acts on it at once
        real_step(self)

    monkeypatch.setattr(Checkpointer, "step", signal_after_step_5)
    with pytest.raises(Preempted):
        _train(tmp_path / "part", *args)
    monkeypatch.undo()
    assert _ckpt(tmp_path / "part" / "checkpoints" / "last.pt")["progress"]["samples_in_epoch"] == 5 * 32
    _train(tmp_path / "part", *args)
    _same_weights(tmp_path / "straight", tmp_path / "part")


@pytest.mark.slow  # slow: the fast suite's budget (make test <= 120 s on 2 cores); CI runs it in make test-slow
def test_a_damaged_last_checkpoint_falls_back_to_the_previous_one(
    straight: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    run_dir = tmp_path / "run"
    shutil.copytree(straight, run_dir)
    last, prev = run_dir / "checkpoints" / "last.pt", run_dir / "checkpoints" / "last.prev.pt"
    prev_step = _ckpt(prev)["progress"]["step"]
    last.write_bytes(last.read_bytes()[: last.stat().st_size // 2])  # a copy cut short

    caplog.set_level(logging.INFO)
    assert _train(run_dir, *RESUMABLE, "train.epochs=3")["steps"] == 24
    assert f"checkpoint {last} is damaged" in caplog.text
    assert f"resuming from {prev}: step {prev_step}" in caplog.text
    # The damaged file was never rotated over the good one: last.prev.pt is a verified checkpoint.
    assert _ckpt(prev)["progress"]["step"] > prev_step


def test_resume_from_an_explicit_checkpoint(straight: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    source = straight / "checkpoints" / "last.pt"
    caplog.set_level(logging.INFO)
    _train(tmp_path / "second", *RESUMABLE, "train.epochs=3", f"checkpoint.resume={source}")
    assert f"resuming from {source}: step 16" in caplog.text
    assert [s for s, _ in _steps(tmp_path / "second", "val/acc")] == [24]


def test_nonfinite_loss_skip(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog) -> None:
    monkeypatch.setenv("IMGTRAIN_FAULT_NAN_CALLS", "3,4")  # tests/faults.py: NaN logits at these steps
    caplog.set_level(logging.INFO)
    metrics = _train(tmp_path, *FAST, "model._target_=faults.build_nan_model", "faults.nonfinite=skip")
    assert metrics["nonfinite_steps"] == 2 and metrics["steps"] == 8
    assert "non-finite loss at step 3: step skipped" in caplog.text
    weights = _ckpt(tmp_path / "checkpoints" / "last.pt")["model"]
    assert all(torch.isfinite(t).all() for t in weights.values() if t.is_floating_point())


@pytest.mark.slow  # a train.py process (5 s on 2 cores); nonfinite=skip's in-process test stays in `make test`
def test_nonfinite_loss_stop_is_one_line_and_exit_status_1(tmp_path: Path, data_dir: Path) -> None:
    """A real process: the exit status, the one stderr line, and failed.json in place of metrics.json."""
    run_dir = tmp_path / "run"
    args = [*FAST, "model._target_=faults.build_nan_model", "checkpoint.every_n_steps=2", "faults.nonfinite=stop"]
    env = {"PYTHONPATH": str(Path(__file__).parent), "IMGTRAIN_FAULT_NAN_CALLS": "3,4"}
    result = run_train(args, run_dir, data_dir, **env)
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


@pytest.mark.parametrize("engine", ["dataloader", "threads"])  # worker processes, loader threads: the same guard
@pytest.mark.parametrize("budget", [pytest.param(10, marks=pytest.mark.slow), 1])  # 10: a whole run (6 s)
def test_unreadable_images_are_skipped_counted_and_budgeted(budget: int, engine: str, tmp_path: Path, caplog) -> None:
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
        "train.epochs=2",
        "metrics.log_every_n_steps=2",
        "metrics.skip_first_steps=0",
        f"data.max_bad_samples={budget}",
        f"data.engine={engine}",
    ]
    run_dir = tmp_path / "run"
    if budget == 10:
        bad_val = tmp_path / "images" / "val" / "class1" / "002.png"
        bad_val.write_bytes(b"not an image either")
        metrics = _train(run_dir, *args)
        assert metrics["skipped_samples"] == 6  # reads: two training files in each of 2 epochs, one val file twice
        assert _steps(run_dir, "data/skipped_samples")[-1][1] == 6
        assert metrics["val_count"] == 11  # 12 validation images, each readable one counted once
        assert metrics["unreadable_files_count"] == 3  # distinct files, with their reasons
        listed = {entry["path"]: entry["reason"] for entry in metrics["unreadable_files"]}
        assert set(listed) == {str(truncated), str(garbage), str(bad_val)} and all(listed.values())
        assert f"skipped an unreadable image: {garbage}" in caplog.text
    else:
        with pytest.raises(RunError, match="data.max_bad_samples=1 exceeded: 2 image reads failed"):
            _train(run_dir, *args)
        assert (run_dir / "checkpoints" / "last.pt").exists()  # the work so far is saved at the boundary
        assert not (run_dir / "metrics.json").exists()
    assert f"skipped an unreadable image: {truncated}" in caplog.text


def test_a_checkpoint_from_another_model_is_a_clear_error(tmp_path: Path) -> None:
    _train(tmp_path, *FAST, "train.max_steps=2")
    with pytest.raises(RunError, match="does not fit this run's model or optimizer") as caught:
        _train(tmp_path, *FAST, "train.max_steps=2", "model=resnet34")
    assert "checkpoint.resume=none" in str(caught.value) and "\n" not in str(caught.value)


def test_rerunning_a_finished_run_keeps_its_results(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    _train(tmp_path, *FAST, "train.max_steps=4")
    before = (tmp_path / "metrics.json").read_text()
    caplog.set_level(logging.INFO)
    _train(tmp_path, *FAST, "train.max_steps=4")
    assert "this run already finished at step 4" in caplog.text
    assert (tmp_path / "metrics.json").read_text() == before


@pytest.mark.slow  # about 19 s: CI runs it in make test-slow
def test_a_full_disk_keeps_the_previous_checkpoint_and_stops_resumably(
    straight: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """ENOSPC in the background writer at the second save: one line, last.pt of the first save kept, and the
    same command later resumes from it to the same weights as an uninterrupted run."""
    real_save, calls = torch.save, []

    def full_disk(obj, f, *args, **kwargs) -> None:
        calls.append(1)
        if len(calls) == 2:
            f.write(b"PK\x03\x04 half")  # what had fitted on the disk
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        real_save(obj, f, *args, **kwargs)

    monkeypatch.setattr(torch, "save", full_disk)
    run_dir = tmp_path / "run"
    with pytest.raises(RunError) as caught:
        _train(run_dir, *RESUMABLE)
    message = str(caught.value)
    assert "could not write the checkpoint of step 6" in message and "No space left on device" in message
    assert f"The last good checkpoint is {run_dir / 'checkpoints' / 'last.pt'} (step 3)" in message
    assert "\n" not in message and "run the same command again" in message
    assert _ckpt(run_dir / "checkpoints" / "last.pt")["progress"]["step"] == 3
    assert not list((run_dir / "checkpoints").glob(".*.tmp"))
    monkeypatch.undo()
    assert _train(run_dir, *RESUMABLE)["steps"] == 16  # space freed: the same command resumes
    _same_weights(straight, run_dir)


@pytest.mark.slow  # a training process killed, then a resume: the SIGTERM test above covers resume in make test
def test_a_kill_during_a_background_write_leaves_a_loadable_checkpoint_and_resume_is_exact(
    straight: Path, tmp_path: Path, data_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """SIGKILL while the writer thread holds the step-6 save between write and rename, with training gone on
    past it: last.pt is step 3's; the next run takes over the dead run's lock and ends as the straight run."""
    run_dir = tmp_path / "run"
    script = textwrap.dedent(
        f"""
        import os, threading, time
        from helpers import RESUMABLE, compose_cfg
        from imgtrain.train.run import run
        real_fsync = os.fsync

        def held_fsync(fd):
            name = os.readlink(f"/proc/self/fd/{{fd}}")
            if threading.current_thread().name.startswith("checkpoint-writer") and ".last.pt." in name:
                if os.path.exists({str(run_dir / "checkpoints" / "last.pt")!r}):
                    time.sleep(600)  # the second save: written, not yet fsynced nor renamed
            return real_fsync(fd)

        os.fsync = held_fsync
        run(compose_cfg(*RESUMABLE, output_dir={str(run_dir)!r}))
        """
    )
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parent), "IMGTRAIN_DATA_DIR": str(data_dir)}
    proc = subprocess.Popen([sys.executable, "-c", script], env=env, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 240
    log_file = run_dir / "checkpoints"
    while not (list(log_file.glob(".last.pt.*.tmp")) and _validated(run_dir)):
        assert proc.poll() is None and time.monotonic() < deadline, "the held save or validation never came"
        time.sleep(0.1)
    proc.kill()  # SIGKILL: no handler runs
    proc.communicate(timeout=60)
    assert checkpoint.load(run_dir / "checkpoints" / "last.pt")["progress"]["step"] == 3

    caplog.set_level(logging.INFO)
    assert _train(run_dir, *RESUMABLE)["steps"] == 16
    assert f"process {proc.pid} is no longer running" in caplog.text  # the dead run's lock, taken over
    assert f"resuming from {run_dir / 'checkpoints' / 'last.pt'}: step 3" in caplog.text
    _same_weights(straight, run_dir)


def _validated(run_dir: Path) -> bool:
    """Whether the first epoch's validation ran (training went on while the save was held)."""
    events = list((run_dir / "tb").glob("events.*"))
    return bool(events) and _has_tag(run_dir, "val/acc")


def _has_tag(run_dir: Path, tag: str) -> bool:
    events = EventAccumulator(str(run_dir / "tb"))
    events.Reload()
    return tag in events.Tags().get("scalars", [])
