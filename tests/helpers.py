"""Test helpers: compose configs through Hydra's API and run train.py as a real subprocess."""

from __future__ import annotations

import copy
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir
from omegaconf import DictConfig

from imgtrain.train.cli import register

ROOT = Path(__file__).resolve().parents[1]
CONF_DIR = ROOT / "conf"

# A run that takes seconds on 2 CPU cores (conf/debug/fast.yaml): 256 images of 32 px, 8 steps of 32.
FAST = ["debug=fast"]

# 2 epochs of 8 steps, deterministic, a checkpoint every 3 steps; one worker, so the stop signal reaches one.
RESUMABLE = [*FAST, "train.epochs=2", "checkpoint.every_n_steps=3", "system.deterministic=true"]

register()


_COMPOSED: dict[tuple[str, ...], DictConfig] = {}  # each list of overrides composed once a process (copies handed out)


def compose_cfg(*overrides: str, output_dir: str = "/tmp/imgtrain-test-unused") -> DictConfig:
    """The config `python train.py <overrides>` would get. Hydra's compose reads and merges every file of the
    defaults list (0.1-0.3 s); the same overrides with another output_dir are the same config but for that key,
    which the rest of the config reads through interpolations, resolved when read."""
    if overrides not in _COMPOSED:
        with initialize_config_dir(version_base="1.3", config_dir=str(CONF_DIR)):
            _COMPOSED[overrides] = compose("config", overrides=[f"output_dir={output_dir}", *overrides])
    cfg = copy.deepcopy(_COMPOSED[overrides])
    if not any(override.startswith("output_dir=") for override in overrides):  # else the later one won
        cfg.output_dir = output_dir
    return cfg


def cuda_roll(monkeypatch: pytest.MonkeyPatch) -> None:
    """Tensor.roll as CUDA's: a contiguous (NCHW) result whatever its input's layout, where the CPU's keeps
    channels_last. torchvision's MixUp builds its output from a roll, so on the CPU this gives the layouts a CUDA
    run's mixing produces."""
    roll = torch.Tensor.roll
    monkeypatch.setattr(torch.Tensor, "roll", lambda self, *args, **kwargs: roll(self, *args, **kwargs).contiguous())


def run_train(
    args: list[str], run_dir: Path, data_dir: Path, timeout: float = 300, **env
) -> subprocess.CompletedProcess:
    """Run `python train.py` in a subprocess, its run directory pinned to `run_dir`."""
    environ = {**os.environ, "IMGTRAIN_DATA_DIR": str(data_dir), "PYTHONUNBUFFERED": "1", **env}
    cmd = [sys.executable, str(ROOT / "train.py"), *args, f"hydra.run.dir={run_dir}"]
    return subprocess.run(cmd, cwd=ROOT, env=environ, capture_output=True, text=True, timeout=timeout)


def read_metrics(run_dir: Path) -> dict:
    return json.loads((run_dir / "metrics.json").read_text())


def run_torchrun(args: list[str], cwd: Path, data_dir: Path, nproc: int = 2, timeout: float = 300):
    """`torchrun --standalone --nproc_per_node=N train.py ...` with `cwd` as the working directory."""
    environ = {**os.environ, "IMGTRAIN_DATA_DIR": str(data_dir), "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]
    cmd += [str(ROOT / "train.py"), *args]
    return subprocess.run(cmd, cwd=cwd, env=environ, capture_output=True, text=True, timeout=timeout)


def start_torchrun(
    args: list[str], cwd: Path, data_dir: Path, launcher: list[str] = (), session: bool = False
) -> subprocess.Popen:
    """Start `torchrun --standalone --nproc_per_node=2 [launcher] train.py args`; stdout and stderr together.
    `session`: in a process group of its own, as a terminal's foreground job (os.killpg then acts as Ctrl-C)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", *launcher]
    env = {**_env(data_dir), "OMP_NUM_THREADS": "1"}
    return subprocess.Popen(
        [*cmd, str(ROOT / "train.py"), *args],
        cwd=cwd,
        env=env,
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=session,
    )


def _env(data_dir: Path, **extra: str) -> dict[str, str]:
    return {**os.environ, "IMGTRAIN_DATA_DIR": str(data_dir), "PYTHONUNBUFFERED": "1", **extra}


def _wait_for(path: Path, proc: subprocess.Popen, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert proc.poll() is None, "the run ended before writing " + str(path)
        assert time.monotonic() < deadline, f"{path} never appeared"
        time.sleep(0.05)


def interrupt(args: list[str], run_dir: Path, data_dir: Path, signum: int = signal.SIGTERM) -> str:
    """Start train.py, send `signum` to its whole process group once last.pt exists; return its stderr."""
    cmd = [sys.executable, str(ROOT / "train.py"), *args, f"hydra.run.dir={run_dir}"]
    # Its own session, so the signal goes to the whole process group (DataLoader worker included), as
    # SLURM and Ctrl-C deliver it.
    proc = subprocess.Popen(cmd, cwd=ROOT, env=_env(data_dir), text=True, start_new_session=True, **_pipes())
    _wait_for(run_dir / "checkpoints" / "last.pt", proc)
    os.killpg(proc.pid, signum)
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signum, stderr
    return stderr


def _pipes() -> dict:
    return {"stdout": subprocess.PIPE, "stderr": subprocess.PIPE}
