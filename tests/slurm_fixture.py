"""The Slurm tests' cluster and what they do with it: submit `python train.py -m hydra/launcher=slurm ...` as a user
would, in the background, and drive the jobs with Slurm's own commands (squeue, sacct, scontrol, scancel).

The cluster (tests/slurm_cluster.py) is started once per test module. Where Slurm's programs are missing, the tests
skip with one line saying so; never where IMGTRAIN_REQUIRE_SLURM or CI is set (.ci/run installs Slurm): they fail.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest
import slurm_cluster
from helpers import ROOT

TESTS = Path(__file__).resolve().parent

# The test node's CPUs and no GPU: one task per job unless a test asks for more, one CPU each
ON_THIS_CLUSTER = ["hydra/launcher=slurm", "hydra.launcher.gpus_per_node=0", "hydra.launcher.tasks_per_node=1"]
ON_THIS_CLUSTER += ["hydra.launcher.cpus_per_task=1", "hydra.launcher.timeout_min=10"]

# A run of milliseconds per step (tests/slurmhelpers.py's tiny CNN on 32-px synthetic images): 64 training images in
# batches of 16, 2 epochs = 8 steps, a checkpoint every 2; 33 validation images (odd: 2 ranks would pad one)
TINY = ["model._target_=slurmhelpers.paced_cnn", "dataset=synthetic", "dataset.image_size=32", "dataset.num_train=64",
        "dataset.num_val=33", "dataset.num_classes=4", "data.batch_size=16", "data.num_workers=0", "train.epochs=2",
        "checkpoint.every_n_steps=2", "metrics.skip_first_steps=1", "metrics.log_every_n_steps=2",
        "metrics.monitor_interval_s=0.1", "metrics.compute_probe=false", "system.deterministic=true"]  # fmt: skip


def _required() -> bool:
    return bool(os.environ.get("IMGTRAIN_REQUIRE_SLURM") or os.environ.get("CI"))


@contextmanager
def started_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[slurm_cluster.Cluster]:
    """A real single-node Slurm cluster with accounting, started for a test module and stopped after it, through the
    script's command line as docs/clusters.md shows it."""
    missing = slurm_cluster.missing_programs()
    if missing and not _required():
        pytest.skip(f"no Slurm here ({', '.join(missing)} missing): apt-get install {slurm_cluster.PACKAGES}")
    folder = tmp_path_factory.mktemp("slurm")
    script = [sys.executable, str(TESTS / "slurm_cluster.py")]
    started = subprocess.run([*script, "start", str(folder)], capture_output=True, text=True, timeout=300)
    try:
        assert started.returncode == 0, started.stderr[-3000:]
        assert started.stdout.strip() == f"export SLURM_CONF={folder.resolve() / 'slurm.conf'}", started.stdout
        yield slurm_cluster.Cluster(folder.resolve())
    finally:
        stopped = subprocess.run([*script, "stop", str(folder)], capture_output=True, text=True, timeout=120)
        assert stopped.returncode == 0, stopped.stderr[-3000:]
        assert not (folder / "pids.json").exists()


@dataclass
class Launch:
    """`python train.py -m <args> hydra.sweep.dir=<sweep>` running in the background; its output in `out`."""

    proc: subprocess.Popen
    sweep: Path
    out: Path
    known: set[str]  # the sweep's submitit folders before this launch: the jobs of earlier launches there

    def finish(self, timeout: float) -> tuple[int, str]:
        """Its exit status and output, once it has ended (killed, and the test failed, after `timeout` s)."""
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            pytest.fail(f"the launcher ran past {timeout:.0f} s: {self.out.read_text()[-3000:]}")
        return self.proc.returncode, self.out.read_text()

    def job_ids(self, count: int = 1, timeout: float = 120) -> list[str]:
        """The Slurm job ids of its jobs (`<array id>_<index>` for an array), once submitted."""
        deadline = time.monotonic() + timeout
        while True:
            names = sorted(_jobs(self.sweep) - self.known)
            ids = [name for name in names if "_" in name] or names  # an array has a folder per task, `<id>_<index>`
            if len(ids) >= count:
                return ids[:count]
            assert self.proc.poll() is None, f"the launcher ended before submitting: {self.out.read_text()[-3000:]}"
            assert time.monotonic() < deadline, "nothing was submitted"
            time.sleep(0.2)

    def job_log(self, job: str) -> str:
        """The job's stdout and stderr, all its attempts (submitit appends)."""
        folder = self.sweep / ".submitit" / job
        return "".join(p.read_text(errors="replace") for p in sorted(folder.glob("*_log.*")))


def _jobs(sweep: Path) -> set[str]:
    folder = sweep / ".submitit"
    return {p.name for p in folder.iterdir() if p.is_dir()} if folder.is_dir() else set()


def launch(cluster: slurm_cluster.Cluster, args: list[str], sweep: Path, data_dir: Path, **env: str) -> Launch:
    """Start the multirun as a user would, from the repository, against `cluster`; `env`: the jobs' test knobs."""
    sweep.parent.mkdir(parents=True, exist_ok=True)
    out = Path(tempfile.mkstemp(dir=sweep.parent, prefix=f"{sweep.name}-launcher-", suffix=".txt")[1])
    path = os.pathsep.join(filter(None, [str(TESTS), os.environ.get("PYTHONPATH")]))
    environ = cluster.env(PYTHONPATH=path, OMP_NUM_THREADS="1", IMGTRAIN_DATA_DIR=str(data_dir), **env)
    cmd = [sys.executable, str(ROOT / "train.py"), "-m", *args, f"hydra.sweep.dir={sweep}"]
    known = _jobs(sweep)
    with open(out, "w") as log:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=environ, stdout=log, stderr=subprocess.STDOUT, text=True)
    return Launch(proc, sweep, out, known)


def wait_for(path: Path, launched: Launch, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert launched.proc.poll() is None, f"the launcher ended before {path}: {launched.out.read_text()[-3000:]}"
        assert time.monotonic() < deadline, f"{path} never appeared"
        time.sleep(0.1)


# How the tests (and docs/clusters.md) ask accounting how a job ended
STATES = ("sacct", "-X", "-P", "-o", "JobID,State,Start,End", "-j")


def job_state(cluster: slurm_cluster.Cluster, job: str) -> str:
    """The job's state as accounting has it, e.g. RUNNING, COMPLETED, TIMEOUT, "CANCELLED by 0"."""
    rows = cluster.command(*STATES, job).splitlines()[1:]
    return rows[0].split("|")[1] if rows else "UNKNOWN"


def wait_for_state(cluster: slurm_cluster.Cluster, job: str, states: set[str], timeout: float) -> str:
    deadline = time.monotonic() + timeout
    while (state := job_state(cluster, job)) not in states:
        assert time.monotonic() < deadline, f"job {job} still {state} after {timeout:.0f} s"
        time.sleep(0.5)
    return state


def metrics(job_dir: Path) -> dict:
    return json.loads((job_dir / "metrics.json").read_text())


def error_lines(output: str) -> list[str]:
    """The launcher's `error:` lines; with no traceback anywhere in its output."""
    assert "Traceback" not in output, output[-3000:]
    return [line for line in output.splitlines() if line.startswith("error:")]
