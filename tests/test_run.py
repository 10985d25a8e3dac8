"""`run(cfg)` in-process through Hydra's compose API: precisions, step limits, start methods, the objective."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from helpers import compose_cfg

from imgtrain.common.errors import ConfigError
from imgtrain.train.placement import resolve_precision
from imgtrain.train.run import NotMeasured, run

SYNTHETIC = [
    "dataset=synthetic",
    "dataset.image_size=32",
    "dataset.num_train=96",
    "dataset.num_val=40",
    "data.batch_size=16",
    "data.num_workers=0",
    "metrics.skip_first_steps=1",
    "metrics.log_every_n_steps=2",
    "metrics.monitor_interval_s=0.1",
]


def _run(tmp_path: Path, *overrides: str) -> tuple[float, dict]:
    value = run(compose_cfg(*SYNTHETIC, *overrides, output_dir=str(tmp_path)))
    return value, json.loads((tmp_path / "metrics.json").read_text())


# bf16 convolutions on CPU are slow: about 15 s for 3 steps on 2 cores.
@pytest.mark.parametrize("precision", ["fp32", pytest.param("bf16", marks=pytest.mark.slow)])
def test_precisions_on_cpu(tmp_path: Path, precision: str) -> None:
    value, metrics = _run(tmp_path, f"system.precision={precision}", "train.max_steps=3")
    assert metrics["precision"] == precision
    assert metrics["steps"] == 3
    assert value == metrics["val_acc"]  # the default objective
    assert math.isfinite(metrics["val_loss"])


def test_max_steps_stops_mid_epoch_and_validates_all(tmp_path: Path) -> None:
    _, metrics = _run(tmp_path, "train.epochs=5", "train.max_steps=8")
    assert metrics["steps"] == 8  # 6 steps per epoch: stops 2 steps into the second epoch
    assert metrics["val_count"] == 40


def test_a_run_too_short_to_measure_says_why(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """...in metrics.json, on the console, and as the objective: not NaN (which ends an Optuna search) but the
    reason, which no sweeper can mistake for a figure."""
    value, metrics = _run(
        tmp_path, "train.max_steps=3", "metrics.skip_first_steps=5", "optimized_metric=images_per_sec"
    )
    assert metrics["images_per_sec"] is None
    assert isinstance(value, NotMeasured) and value.startswith("images_per_sec not measured: all 3 steps")
    with pytest.raises(ValueError):
        float(value)
    note = metrics["images_per_sec_note"]
    assert "all 3 steps of this run were warm-up steps (metrics.skip_first_steps=5)" in note and "max_steps" in note
    assert f"images/s (steady state)      {note}" in capsys.readouterr().out
    _, measured = _run(tmp_path / "longer", "train.max_steps=6")
    assert measured["images_per_sec"] > 0 and measured["images_per_sec_note"] is None


def test_optimized_metric_is_returned(tmp_path: Path) -> None:
    value, metrics = _run(tmp_path, "train.max_steps=6", "optimized_metric=images_per_sec")
    assert value == pytest.approx(metrics["images_per_sec"]) and value > 0


def test_label_smoothing_and_adamw(tmp_path: Path) -> None:
    _, metrics = _run(tmp_path, "optim=adamw", "loss.label_smoothing=0.1", "train.max_steps=3")
    assert metrics["steps"] == 3 and math.isfinite(metrics["val_loss"])


@pytest.mark.slow  # workers that import torch anew
@pytest.mark.parametrize("method", ["spawn", "forkserver"])
def test_spawn_and_forkserver_workers(tmp_path: Path, method: str, data_dir: Path) -> None:
    overrides = [
        "dataset=shapes",
        "dataset.num_train=64",
        "dataset.num_val=16",
        "dataset.image_size=32",
        "data.num_workers=1",
        f"data.multiprocessing_context={method}",
        "train.max_steps=3",
    ]
    _, metrics = _run(tmp_path, *overrides)
    assert metrics["loader"]["multiprocessing_context"] == method and metrics["steps"] == 3


def test_batch_larger_than_dataset_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="data.batch_size=128"):
        _run(tmp_path, "data.batch_size=128")
    assert not (tmp_path / "metrics.json").exists()


def test_precision_the_device_cannot_do() -> None:
    import torch

    with pytest.raises(ConfigError, match="system.precision=fp16"):
        resolve_precision("fp16", torch.device("cpu"))
    assert resolve_precision("auto", torch.device("cpu")) == "fp32"


def test_workers_are_shut_down_when_a_job_ends(tmp_path: Path, data_dir: Path) -> None:
    import psutil

    overrides = [
        "dataset=shapes",
        "dataset.num_train=64",
        "dataset.num_val=16",
        "dataset.image_size=32",
        "data.num_workers=2",
        "data.persistent_workers=true",
        "train.max_steps=3",
    ]
    before = {p.pid for p in psutil.Process().children(recursive=True)}  # e.g. an earlier test's forkserver
    _run(tmp_path, *overrides)
    # The next job of an in-process sweep must not share the CPUs with this job's persistent workers.
    assert [p for p in psutil.Process().children(recursive=True) if p.pid not in before] == []


@pytest.mark.slow  # torch.compile builds C++ kernels on CPU: about a minute on 2 cores
def test_compile(tmp_path: Path) -> None:
    _, metrics = _run(tmp_path, "system.compile=true", "train.max_steps=3")
    assert metrics["steps"] == 3 and math.isfinite(metrics["val_loss"])


def test_auto_precision_is_bf16_only_where_the_gpu_in_use_has_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """torch.cuda.is_bf16_supported() also says yes on GPUs that emulate bf16; ask the device in use."""
    import torch

    asked = []
    capability = {0: (9, 0), 1: (7, 0)}  # an H100 as device 0, a V100 as device 1
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d: asked.append(d) or capability[d.index])
    assert resolve_precision("auto", torch.device("cuda", 0)) == "bf16"
    assert resolve_precision("auto", torch.device("cuda", 1)) == "fp32"
    assert asked == [torch.device("cuda", 0), torch.device("cuda", 1)]
    with pytest.raises(ConfigError, match="needs compute capability 8.0 or higher, and cuda:1 has 7.0"):
        resolve_precision("bf16", torch.device("cuda", 1))


@pytest.mark.parametrize("deterministic", [False, True])
def test_cudnn_autotunes_unless_the_run_is_deterministic(tmp_path: Path, deterministic: bool) -> None:
    import torch

    torch.backends.cudnn.benchmark = deterministic  # the opposite of what the run must set
    _run(tmp_path, f"system.deterministic={str(deterministic).lower()}", "train.max_steps=1")
    assert torch.backends.cudnn.benchmark is (not deterministic)
    assert torch.are_deterministic_algorithms_enabled() is deterministic
    torch.use_deterministic_algorithms(False)


def test_compute_ceiling_runs_max_steps_whatever_the_dataset_size(tmp_path: Path) -> None:
    """96 images of batch 16 are 6 steps an epoch; a ceiling measurement must not stop there."""
    _, metrics = _run(tmp_path, "mode=compute", "train.epochs=1", "train.max_steps=15")
    assert metrics["steps"] == 15 and metrics["measured_steps"] == 14  # all but the one warm-up step


def test_compiled_jobs_reset_dynamo_for_the_next_job_of_a_sweep(tmp_path: Path, monkeypatch) -> None:
    import torch

    resets = []
    monkeypatch.setattr(torch, "compile", lambda model, **kw: model)  # what is compiled does not matter here
    monkeypatch.setattr(torch._dynamo, "reset", lambda: resets.append(1))
    _run(tmp_path / "a", "system.compile=true", "train.max_steps=1")
    assert resets == [1]
    _run(tmp_path / "b", "train.max_steps=1")
    assert resets == [1]  # nothing compiled, nothing to reset
