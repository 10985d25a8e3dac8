"""Shared by the dataset=shards tests: a run of seconds on shards, the converter, and the one-line error of a run."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
from helpers import compose_cfg

from imgtrain.common.errors import RunError
from imgtrain.data.shards import command
from imgtrain.resilience.checkpoint import Checkpointer
from imgtrain.resilience.faults import Preempted
from imgtrain.train.run import run


def shards_args(root: Path | str, *more: str) -> list[str]:
    """A run of seconds on the 32-px shards below (debug=fast's settings; it sets keys only `shapes` has)."""
    fast = ["dataset.image_size=32", "data.batch_size=32", "data.num_workers=1", "train.epochs=1"]
    fast += ["metrics.skip_first_steps=2", "metrics.log_every_n_steps=2", "metrics.monitor_interval_s=0.1"]
    return ["dataset=shards", f"dataset.root={root}", *fast, "metrics.compute_probe=false", *more]


def failure(*overrides: str, run_dir: Path) -> RunError:
    """The one-line error `python train.py <overrides>` stops with (Hydra's instantiate wraps it: unwrapped here,
    as the command line's `cli.one_line` does)."""
    with pytest.raises(Exception) as caught:  # noqa: PT011 - the error inside is checked below
        run(compose_cfg(*overrides, output_dir=str(run_dir)))
    error: BaseException | None = caught.value
    while error is not None and not isinstance(error, RunError):
        error = error.__cause__
    assert error is not None and "\n" not in str(error), caught.value
    return error


def pack(src: Path | str, dst: Path | str, *flags: str) -> int:
    return command.main([str(src), str(dst), "--workers", "2", *flags])


@contextmanager
def slowed_conversion(
    source: Path, dst: Path, tmp: Path, slowed: str = "/", workers: int = 2
) -> Iterator[subprocess.Popen]:
    """The converter in a process group of its own, each image whose path holds `slowed` decoded 0.05 s slower (its
    forked workers inherit the patch), staging under `tmp` (TMPDIR), its stdout and stderr piped; the group is
    killed on the way out if it still runs (a failed test leaves nothing running)."""
    code = (
        "import sys, time; from imgtrain.data.shards import convert as c; real = c.decode_problem; "
        f"c.decode_problem = lambda data, path, *limit: time.sleep(0.05) or real(data, path, *limit) if {slowed!r} in "
        f"path else real(data, path, *limit); "
        f"sys.exit(c.main([{str(source)!r}, {str(dst)!r}, '--workers', '{workers}']))"
    )
    env = {**os.environ, "TMPDIR": str(tmp), "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(
        [sys.executable, "-c", code], env=env, start_new_session=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    try:
        yield proc
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def staging_folder(proc: subprocess.Popen) -> Path:
    """Where a conversion stages its files: its first line says so."""
    line = proc.stdout.readline().decode()
    assert line.startswith("staging in "), line
    return Path(line.split()[2])


def stop_after_step_5(monkeypatch: pytest.MonkeyPatch, args: list[str], run_dir: Path) -> dict:
    """`run(args)` in this process with a SIGTERM during step 5 (saved when the step ends, mid-epoch, as a stop
    signal is); returns the checkpoint it saved."""
    real_step = Checkpointer.step

    def signal_after_step_5(self: Checkpointer) -> None:
        if self.progress.step == 5:
            os.kill(os.getpid(), signal.SIGTERM)
        real_step(self)

    monkeypatch.setattr(Checkpointer, "step", signal_after_step_5)
    with pytest.raises(Preempted):
        run(compose_cfg(*args, output_dir=str(run_dir)))
    monkeypatch.setattr(Checkpointer, "step", real_step)
    return torch.load(run_dir / "checkpoints" / "last.pt", map_location="cpu", weights_only=True)
