"""The seam between training and measuring (train/instruments.py): the hooks fan out to the instruments that define
them, the ranks agree once per logging window whatever measures the run, and a run trains the same with an
instrument removed, or with none, alone and under torchrun."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import FAST, ROOT, compose_cfg
from torch import nn

from imgtrain.metrics.processor import Metrics
from imgtrain.metrics.profiling import Profiler
from imgtrain.resilience.agreement import Agreement, LoggingWindows
from imgtrain.train import run as run_module
from imgtrain.train.instruments import HOOKS, Instrument, Instruments, no_range


def tiny_cnn(num_classes: int, **torchvision_keys: object) -> nn.Module:
    """A model of milliseconds per step (model._target_=test_instruments.tiny_cnn); `torchvision_keys` unused."""
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                         nn.Linear(8, num_classes))  # fmt: skip


# 64 training images in 4 steps of 16, 32 validation images, 2 epochs, a window every 2 steps: seconds on 2 cores
TINY = ["model._target_=test_instruments.tiny_cnn", "dataset=synthetic", "dataset.image_size=32",
        "dataset.num_train=64", "dataset.num_val=32", "dataset.num_classes=4", "data.batch_size=16",
        "data.num_workers=0", "train.epochs=2", "metrics.skip_first_steps=1", "metrics.log_every_n_steps=2",
        "metrics.monitor_interval_s=0.1", "metrics.compute_probe=false", "system.deterministic=true"]  # fmt: skip


class Recorder(Instrument):
    """Records the hooks it defines; `on_window` sees the agreement."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def on_step_end(self, step: int, loss: torch.Tensor, logits: torch.Tensor, labels: torch.Tensor) -> None:
        self.calls.append(("step", step))

    def window_report(self, step: int) -> dict[str, float]:
        return {"images_per_sec": 10.0}

    def on_window(self, step: int, agreed: Agreement) -> None:
        self.calls.append(("window", step, agreed.images_per_sec))


def test_the_metrics_and_the_profiler_define_only_hooks_the_loop_calls() -> None:
    """They sit below train/ and cannot subclass `Instrument`: a misspelt hook would never be called."""
    for cls in (Metrics, Profiler):
        hooks = {name for name in vars(cls) if name.startswith(("on_", "window_"))}
        assert hooks and hooks <= set(HOOKS), (cls, hooks - set(HOOKS))
    assert {"summary", "range", "failure_notes"} <= set(HOOKS)


def test_hooks_fan_out_to_the_instruments_that_define_them_and_no_instrument_marks_nothing() -> None:
    recorder, bare = Recorder(), Instrument()
    instruments = Instruments([recorder, bare])
    assert instruments._step_hooks == [recorder.on_step_end]  # the base's no-ops cost nothing per step
    assert instruments.range is no_range and Instruments().range is no_range
    loss = torch.zeros(())
    instruments.on_step_end(1, loss, loss, loss)
    assert instruments.window_report(1) == {"images_per_sec": 10.0} and Instruments().window_report(1) == {}
    assert recorder.calls == [("step", 1)] and instruments.failure_notes() == ""


def test_the_window_exchange_is_the_loops_and_happens_once_per_window() -> None:
    class Party:
        def __init__(self) -> None:
            self.reports, self.agreed = 0, []

        def report(self) -> dict[str, int]:
            self.reports += 1
            return {"unreadable": 2}

        def agree(self, agreed: Agreement) -> None:
            self.agreed.append(agreed.unreadable)

    party, recorder = Party(), Recorder()
    windows = LoggingWindows(4, total_steps=10, parties=[party], also_at=(3,))
    assert [step for step in range(1, 11) if windows.due(step)] == [3, 4, 8]  # never at the run's last step
    instruments = Instruments([recorder])
    windows.begin(0)
    assert windows.open(1)
    agreed = windows.agree(4, instruments.window_report(4))
    instruments.on_window(4, agreed)
    assert (party.reports, party.agreed) == (1, [2]) and recorder.calls == [("window", 4, 10.0)]
    assert not windows.open(4) and windows.open(5)


def _without(monkeypatch: pytest.MonkeyPatch, *removed: type) -> None:
    """`run`'s list of instruments with those of the `removed` classes deleted, as a fork deletes their lines."""
    build = run_module.instruments_for
    monkeypatch.setattr(
        run_module, "instruments_for", lambda *args: [item for item in build(*args) if not isinstance(item, removed)]
    )


def _weights(run_dir: Path) -> dict[str, torch.Tensor]:
    return torch.load(run_dir / "checkpoints" / "last.pt", map_location="cpu", weights_only=True)["model"]


def test_a_run_trains_the_same_with_the_profiler_removed_and_with_no_instrument(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, data_dir: Path
) -> None:
    """No profiler: metrics.json as ever, no trace. No instrument: the same weights, bit for bit, a checkpoint and
    the validation figures `run` returns, but no metrics.json (what writes it was removed) and no TensorBoard."""
    full = tmp_path / "full"
    value = run_module.run(compose_cfg(*TINY, output_dir=str(full)))
    _without(monkeypatch, Profiler)
    unprofiled = tmp_path / "unprofiled"
    assert run_module.run(compose_cfg(*TINY, "metrics.profile=true", output_dir=str(unprofiled))) == value
    metrics = json.loads((unprofiled / "metrics.json").read_text())
    assert metrics["profile_trace"] is None and metrics["steps"] == 8 and not (unprofiled / "profile").exists()
    _without(monkeypatch, Metrics, Profiler)
    bare = tmp_path / "bare"
    assert run_module.run(compose_cfg(*TINY, output_dir=str(bare))) == value == metrics["val_acc"]
    assert not (bare / "metrics.json").exists() and not (bare / "tb").exists()
    full_weights, bare_weights = _weights(full), _weights(bare)
    assert all(torch.equal(full_weights[name], bare_weights[name]) for name in full_weights)


# torchrun runs this instead of train.py: the same entry point, with `run`'s list of instruments emptied
NO_INSTRUMENTS = """
import runpy, sys
from imgtrain.train import run
run.instruments_for = lambda *args: []
sys.argv[0] = {train!r}
runpy.run_path({train!r}, run_name="__main__")
"""


@pytest.mark.slow  # two torchrun processes start, import torch and train: about 20 s on 2 cores
def test_two_ranks_train_and_agree_with_no_instrument(tmp_path: Path, data_dir: Path) -> None:
    """Under torchrun (gloo, 2 CPU ranks) the ranks still exchange once per window: the run ends at the same step
    on both, saves its checkpoint, and writes no metrics.json."""
    script = tmp_path / "bare_train.py"
    script.write_text(NO_INSTRUMENTS.format(train=str(ROOT / "train.py")))
    run_dir = tmp_path / "run"
    args = [*FAST, "data.num_workers=0", "train.epochs=2", f"hydra.run.dir={run_dir}"]
    environ = {**os.environ, "IMGTRAIN_DATA_DIR": str(data_dir), "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    environ["PYTHONPATH"] = os.pathsep.join([str(ROOT), environ.get("PYTHONPATH", "")])  # train.py's directory
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(script)]
    result = subprocess.run([*torchrun, *args], cwd=ROOT, env=environ, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-4000:]
    assert (run_dir / "checkpoints" / "last.pt").is_file() and not (run_dir / "metrics.json").exists()
    saved = torch.load(run_dir / "checkpoints" / "last.pt", map_location="cpu", weights_only=True)
    assert saved["progress"]["step"] == 8  # 2 epochs x (256 / 2 ranks / 32)
