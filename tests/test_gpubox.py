"""The GPU box on this machine: what `make test-gpu` and the GPU benchmark sections need there (train.py, bench.py,
the test collection, a run) works with the optional engines absent from disk (tests/gpubox.py), and a run that
needs a missing one ends in one line naming it, with exit status 2. The collection runs in `make test`, the rest
(each a process of seconds) in `make test-slow`."""

from __future__ import annotations

import subprocess
from pathlib import Path

import gpubox
import pytest
from helpers import ROOT

TIMEOUT_S = 120


@pytest.fixture(scope="module")
def site_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return gpubox.site_without(tmp_path_factory.mktemp("gpubox") / "site-packages")


def _run(site_dir: Path, *args: str) -> subprocess.CompletedProcess:
    argv, env = gpubox.command(site_dir, *args)
    return subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=TIMEOUT_S)


ABSENT = ["litdata", "boto3", "botocore", "obstore", "optuna", "moto", "torchcodec", "sklearn", "scipy"]
ABSENT += ["hydra_plugins.hydra_optuna_sweeper"]


def _make(site_dir: Path, *args: str) -> subprocess.CompletedProcess:
    """`make <args> NOVENV=1` with the GPU box's Python: what docs/gpu.md tells that machine to type."""
    argv, env = gpubox.command(site_dir)
    env["PYTHONPATH"] = str(site_dir)  # the Makefile adds src/
    python = " ".join(argv)  # the interpreter with -S
    command = ["make", "-s", *args, "NOVENV=1", f"PYTHON={python}"]
    return subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=TIMEOUT_S)


def test_make_test_gpu_collects_every_cuda_test_there(site_dir: Path) -> None:
    """`make test-gpu NOVENV=1` installs nothing and collects every CUDA test, the modules of the absent engines
    reported as skipped, not errors. First, the emulation itself: each absent package is absent (so this test can
    fail), Hydra is there."""
    probe = f"import importlib.util as u; print([m for m in {ABSENT} if u.find_spec(m)]); import hydra, omegaconf"
    assert _run(site_dir, "-c", probe).stdout == "[]\n"
    result = _make(site_dir, "test-gpu", "PYTEST_ARGS=--collect-only -q -p no:cacheprovider")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    collected = [line for line in result.stdout.splitlines() if line.startswith("tests/test_gpu.py::")]
    assert len(collected) >= 15 and "error" not in result.stdout.lower()
    assert "SKIPPED [1] tests/test_shards.py" in result.stdout  # litdata: the whole module, said


@pytest.mark.slow
def test_make_bench_gpu_starts_there(site_dir: Path) -> None:
    result = _make(site_dir, "bench-gpu", "ARGS=--help")  # bench.py imports everything before parsing
    assert result.returncode == 0 and result.stdout.startswith("usage: bench.py"), result.stderr[-3000:]
    planned = _make(site_dir, "-n", "test-gpu", "bench-gpu").stdout  # what make would run: no set-up
    assert "pip install" not in planned and "-m venv" not in planned and f"PYTHONPATH={ROOT}/src" in planned


@pytest.mark.slow
def test_a_synthetic_run_trains_there(site_dir: Path, tmp_path: Path) -> None:
    result = _run(site_dir, "train.py", "debug=fast", "dataset=synthetic", f"hydra.run.dir={tmp_path}")
    assert result.returncode == 0, result.stderr[-3000:]
    assert (tmp_path / "metrics.json").exists()
    assert "Error importing" not in result.stderr and "Traceback" not in result.stderr  # Hydra's plugin scan


@pytest.mark.slow
@pytest.mark.parametrize(
    ("args", "line"),
    [
        (["train.py", "dataset=shards", "dataset.root={tmp}"], "error: dataset=shards needs litdata"),
        (["train.py", "-m", "hparams_search=loader"], "error: hparams_search (Optuna's sweeper) needs hydra-optuna"),
        (["-m", "imgtrain.data.shards.command", "{tmp}", "{tmp}/out"], "error: imgtrain-shards needs litdata"),
        (["train.py", "debug=fast"], "error: dataset=shapes needs TorchCodec"),  # torchvision >= 0.29 here
    ],
    ids=["shards", "search", "imgtrain-shards", "decoder"],
)
def test_a_run_that_needs_an_absent_engine_ends_in_one_line(
    site_dir: Path, tmp_path: Path, args: list[str], line: str
) -> None:
    args = [arg.format(tmp=tmp_path) for arg in args]
    if args[0] == "train.py":  # Hydra's run directories away from the repository
        args += [f"hydra.run.dir={tmp_path}/run", f"hydra.sweep.dir={tmp_path}/sweep"]
    result = _run(site_dir, *args)
    assert result.returncode == 2, result.stderr[-3000:]
    assert result.stderr.strip().splitlines() == [result.stderr.strip()] and result.stderr.startswith(line)
    assert "pip install" in result.stderr
