"""Bad input: one line naming the key and what is accepted, no traceback, nothing left behind; exit status 2.

The messages are checked in the test process (through compose() and run()); a few real `train.py` processes
check what only a process shows: the exit status, stderr, and HYDRA_FULL_ERROR.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers import compose_cfg, run_train
from hydra.errors import ConfigCompositionException
from omegaconf.errors import ValidationError

from imgtrain.common.errors import is_bad_input
from imgtrain.train.cli import one_line
from imgtrain.train.run import run


def test_one_line_keeps_key_and_reason() -> None:
    cause = ValidationError(
        "Value 'abc' of type 'str' could not be converted to Integer\n    full_key: data.batch_size"
    )
    error = ConfigCompositionException("Error merging override data.batch_size=abc")
    error.__cause__ = cause
    assert one_line(error) == (
        "Error merging override data.batch_size=abc: Value 'abc' of type 'str' could not be converted to Integer"
    )


def test_one_line_lists_group_options_without_schemas() -> None:
    error = ConfigCompositionException(
        "In 'config': Could not find 'dataset/bogus'\n\nAvailable options in 'dataset':\n\tbase_shapes\n\tcifar10\n"
        "\tshapes\nConfig search path:\n\tprovider=hydra, path=pkg://hydra.conf"
    )
    assert one_line(error) == (
        "In 'config': Could not find 'dataset/bogus': Available options in 'dataset': cifar10, shapes"
    )


# A fake CUDA with one GPU, for the cases a CPU-only machine could not otherwise reach.
FAKE_ONE_GPU = "import torch; torch.cuda.is_available = lambda: True; torch.cuda.device_count = lambda: 1\n"
# torchrun's variables for local rank 0 of 2 processes on this node (the check runs before any rendezvous).
TWO_PROCESSES = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2"}

BAD_INPUT = [
    ("data.num_workers=-1", "data.num_workers=-1 is invalid: expected an integer >= 0, auto or tune"),
    ("data.batch_size=0", "data.batch_size=0 is invalid: expected an integer >= 1"),
    ("data.prefetch_factor=0", "data.prefetch_factor=0 is invalid: expected null or an integer >= 1"),
    ("data.multiprocessing_context=threads", "expected one of [fork, spawn, forkserver]"),
    (
        "dataset=bogus",
        "Available options in 'dataset': cifar10, cifar100, csv, custom, imagefolder, shapes, shards, synthetic",
    ),
    ("data.no_such_key=1", "Key 'no_such_key' not in 'DataConfig'"),
    ("data.batch_size=abc", "data.batch_size=abc: Value 'abc' of type 'str' could not be converted to Integer"),
    ("system.precision=fp16", "system.precision=fp16 needs a CUDA device: on CPU use fp32 or bf16"),
    ("system.device=cuda", "system.device=cuda but no CUDA GPU is visible: use system.device=auto or cpu"),
    ("dataset=imagefolder dataset.root=/no/such/dir", "dataset.root=/no/such/dir is not a directory"),
    ("dataset=imagefolder dataset.root={empty}", "has no class folders with images"),
    ("dataset=imagefolder dataset.root={empty} dataset.val_fraction=1.5", "dataset.val_fraction=1.5 is invalid"),
    ("faults.nonfinite=ignore", "faults.nonfinite=ignore: Invalid value 'ignore', expected one of [stop, skip]"),
    ("checkpoint.resume=/no/such.pt", "checkpoint.resume=/no/such.pt is invalid: expected auto, none or the path"),
    ("dataset=shards", "dataset.root is required with dataset=shards"),
    ("dataset=shards dataset.root=/no/such/dir", "dataset.root=/no/such/dir is not a directory"),
    ("dataset=shards dataset.root={empty}", "has no imgtrain-shards.json (it holds no imgtrain shards)"),
    ("dataset=shards dataset.root=s3://", "dataset.root=s3://: '' is not an S3 bucket name"),
    ("dataset=shards dataset.root={empty} dataset.cache_limit_gb=0", "dataset.cache_limit_gb=0.0 is invalid"),
    ("data.max_bad_samples=-1", "data.max_bad_samples=-1 is invalid: expected null (no limit) or an integer >= 0"),
    ("dataset=cifar10", "download failed (offline?). Download cifar-10-python.tar.gz"),
]


@pytest.mark.parametrize(("override", "expected"), BAD_INPUT, ids=[case[0].split()[-1] for case in BAD_INPUT])
def test_bad_input_is_one_clear_line(override: str, expected: str, tmp_path: Path, data_dir: Path) -> None:
    (tmp_path / "empty").mkdir()
    run_dir = tmp_path / "run"
    with pytest.raises(Exception) as caught:  # noqa: PT011 - what is raised is the point: one line, the right kind
        run(compose_cfg(*override.replace("{empty}", str(tmp_path / "empty")).split(), output_dir=str(run_dir)))
    line = one_line(caught.value)
    assert expected in line and "\n" not in line, line
    assert line.count(expected) == 1  # said once, not repeated by a wrapping exception
    assert is_bad_input(caught.value)  # exit status 2, not 1
    # Nothing that looks like a finished run: no metrics, no checkpoints, no TensorBoard events.
    for leftover in ("metrics.json", "checkpoints", "tb"):
        assert not (run_dir / leftover).exists(), leftover


@pytest.mark.parametrize(
    ("override", "expected"),
    [  # each a train.py process (3.4 s on 2 cores): one in `make test`, the rest in `make test-slow`
        ("data.num_workers=-1", "error: data.num_workers=-1 is invalid: expected an integer >= 0, auto or tune"),
        pytest.param(
            "system.device=cuda {fake_gpu}",
            "2 processes on this node but only 1 GPU(s) are visible",
            marks=pytest.mark.slow,
        ),
        pytest.param(
            "trainer.epochs=3",
            "error: trainer.epochs is now train.epochs (trainer.* was split by concern",
            marks=pytest.mark.slow,
        ),
        pytest.param(
            "-m hydra.callbacks.sweep_report.min_gain=2",
            "sweep_report.min_gain=2: expected a fraction in [0, 1)",
            marks=pytest.mark.slow,
        ),
    ],
    ids=["validation", "device", "composition", "sweep-callback"],
)
def test_train_py_exits_2_with_one_line_on_stderr(override: str, expected: str, tmp_path: Path, data_dir: Path):
    env = {}
    if "{fake_gpu}" in override:
        (tmp_path / "sitecustomize.py").write_text(FAKE_ONE_GPU)
        env = {**TWO_PROCESSES, "PYTHONPATH": str(tmp_path)}
    run_dir = tmp_path / "run"
    result = run_train(override.replace("{fake_gpu}", "").split(), run_dir, data_dir, timeout=120, **env)
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: ") and expected in lines[0], result.stderr
    for leftover in ("metrics.json", "checkpoints", "tb"):
        assert not (run_dir / leftover).exists(), leftover


@pytest.mark.slow  # a train.py process
def test_full_error_env_keeps_the_traceback(tmp_path: Path, data_dir: Path) -> None:
    result = run_train(["data.num_workers=-1"], tmp_path / "run", data_dir, timeout=120, HYDRA_FULL_ERROR="1")
    assert result.returncode != 0 and "Traceback" in result.stderr
