"""The GPU box on this machine: what `make test-gpu` and the GPU benchmark sections need there (train.py, bench.py,
the test collection, a run) works with the optional engines absent from disk and the device wheels installed the
documented way (tests/gpubox.py; without ../shared/device-wheels, this venv's copies of their packages are linked
in instead), and a run that needs a missing one ends in one line naming it, with exit status
2. The collection runs in `make test`, the rest (each a process of seconds) in `make test-slow`."""

from __future__ import annotations

import subprocess
from pathlib import Path

import gpubox
import pytest
from helpers import ROOT

TIMEOUT_S = 120


def _run(box: gpubox.Box | Path, *args: str) -> subprocess.CompletedProcess:
    argv, env = gpubox.command(box, *args)
    return subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=TIMEOUT_S)


ABSENT = ["litdata", "boto3", "botocore", "obstore", "optuna", "moto", "torchcodec", "sklearn", "scipy"]
WHEELS = ["hydra", "omegaconf", "antlr4", "submitit", "hydra_plugins.hydra_submitit_launcher"]  # device wheels


def make(box: gpubox.Box, *args: str, timeout: float = TIMEOUT_S) -> subprocess.CompletedProcess:
    """`make <args> NOVENV=1` with the GPU box's Python: what docs/gpu.md tells that machine to type, after the
    device wheels' PYTHONPATH line."""
    argv, env = gpubox.command(box)
    env["PYTHONPATH"] = box.pythonpath  # the Makefile adds src/
    python = " ".join(argv)  # the interpreter with -S
    command = ["make", "-s", *args, "NOVENV=1", f"PYTHON={python}"]
    return subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


@pytest.mark.slow  # slow: the fast suite's budget (make test <= 120 s on 2 cores); CI runs it in make test-slow
def test_make_test_gpu_collects_every_cuda_test_there(gpu_box: gpubox.Box) -> None:
    """`make test-gpu NOVENV=1` installs nothing and collects every CUDA test, the modules of the absent engines
    reported as skipped, not errors. First, the emulation itself: each absent package is absent (so this test can
    fail), Hydra too until the device wheels are on the path; with them, Hydra is there, from them."""
    probe = f"import importlib.util as u; print([m for m in {ABSENT + WHEELS} if u.find_spec(m)])"
    assert _run(gpu_box.site, "-c", probe).stdout == "[]\n"
    probe = f"import importlib.util as u; print([m for m in {ABSENT} if u.find_spec(m)]); import hydra, omegaconf"
    probe += "; print(hydra.__file__, omegaconf.__file__)"
    lines = _run(gpu_box, "-c", probe).stdout.splitlines()
    assert lines[0] == "[]" and all(path.startswith(str(gpu_box.wheels)) for path in lines[1].split())
    result = make(gpu_box, "test-gpu", "PYTEST_ARGS=--collect-only -q -p no:cacheprovider")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    collected = [line for line in result.stdout.splitlines() if line.startswith("tests/test_gpu.py::")]
    assert len(collected) >= 15 and "error" not in result.stdout.lower()
    assert "SKIPPED [1] tests/test_shards.py" in result.stdout  # litdata: the whole module, said


@pytest.mark.slow
def test_make_bench_gpu_starts_there(gpu_box: gpubox.Box) -> None:
    result = make(gpu_box, "bench-gpu", "ARGS=--help")  # bench.py imports everything before parsing
    assert result.returncode == 0 and result.stdout.startswith("usage: bench.py"), result.stderr[-3000:]
    planned = make(gpu_box, "-n", "test-gpu", "bench-gpu", "gpu-check").stdout  # what make would run: no set-up
    assert "pip install" not in planned and "-m venv" not in planned and f"PYTHONPATH={ROOT}/src" in planned


@pytest.mark.slow
def test_a_synthetic_run_trains_there(gpu_box: gpubox.Box, tmp_path: Path) -> None:
    result = _run(gpu_box, "train.py", "debug=fast", "dataset=synthetic", f"hydra.run.dir={tmp_path}")
    assert result.returncode == 0, result.stderr[-3000:]
    assert (tmp_path / "metrics.json").exists()
    assert "Error importing" not in result.stderr and "Traceback" not in result.stderr  # Hydra's plugin scan


@pytest.mark.slow
@pytest.mark.parametrize(
    ("args", "line"),
    [
        (["train.py", "dataset=shards", "dataset.root={tmp}"], "error: dataset=shards needs litdata"),
        (["train.py", "-m", "hparams_search=loader"], "error: hparams_search (Optuna's search) needs optuna"),
        (["-m", "imgtrain.data.shards.command", "{tmp}", "{tmp}/out"], "error: imgtrain-shards needs litdata"),
        (["train.py", "debug=fast"], "error: dataset=shapes needs TorchCodec"),  # torchvision >= 0.29 here
    ],
    ids=["shards", "search", "imgtrain-shards", "decoder"],
)
def test_a_run_that_needs_an_absent_engine_ends_in_one_line(
    gpu_box: gpubox.Box, tmp_path: Path, args: list[str], line: str
) -> None:
    if "TorchCodec" in line and gpubox.torchcodec_installed(gpu_box):
        pytest.skip("the device wheels' TorchCodec installed for this Python: there is a CPU decoder here")
    args = [arg.format(tmp=tmp_path) for arg in args]
    if args[0] == "train.py":  # Hydra's run directories away from the repository
        args += [f"hydra.run.dir={tmp_path}/run", f"hydra.sweep.dir={tmp_path}/sweep"]
    result = _run(gpu_box, *args)
    assert result.returncode == 2, result.stderr[-3000:]
    assert result.stderr.strip().splitlines() == [result.stderr.strip()] and result.stderr.startswith(line)
    assert "pip install" in result.stderr
