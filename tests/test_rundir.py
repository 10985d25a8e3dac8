"""One writer per run directory: a second run is refused with one line, a dead run's lock is taken over."""

from __future__ import annotations

import errno
import json
import logging
import os
import socket
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
from helpers import FAST, compose_cfg, run_train

from imgtrain.common.errors import ConfigError, RunError
from imgtrain.resilience import rundir
from imgtrain.resilience.rundir import LOCK_NAME, STALE_AFTER_S, RunDirLock
from imgtrain.train.run import run


@pytest.fixture
def holder(tmp_path: Path):
    """Another process holding tmp_path/run's lock, as a run in a second terminal would."""
    run_dir = tmp_path / "run"
    script = textwrap.dedent(
        f"""
        import pathlib, time
        from imgtrain.resilience.rundir import RunDirLock
        with RunDirLock(pathlib.Path({str(run_dir)!r})):
            print("locked", flush=True)
            time.sleep(600)
        """
    )
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "locked"
    yield run_dir, proc
    proc.kill()
    proc.wait(timeout=30)


def _write_lock(run_dir: Path, heartbeat: float | None = None, **fields) -> None:
    """A lock file as another holder leaves it; its heartbeat is the file's mtime."""
    now = time.time()
    holder = {"pid": 1, "host": "elsewhere", "started": now, "job": "", "token": "x", **fields}
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / LOCK_NAME).write_text(json.dumps(holder))
    beat = now if heartbeat is None else heartbeat
    os.utime(run_dir / LOCK_NAME, (beat, beat))


@pytest.mark.slow  # slow: the fast suite's budget (make test <= 120 s on 2 cores); CI runs it in make test-slow
def test_a_second_run_in_a_held_directory_is_refused_before_touching_it(holder, data_dir: Path) -> None:
    run_dir, proc = holder
    before = (run_dir / LOCK_NAME).read_text()
    with pytest.raises(RunError) as caught:
        run(compose_cfg(*FAST, output_dir=str(run_dir)))
    message = str(caught.value)
    assert f"is in use by pid {proc.pid} on {socket.gethostname()}" in message and "\n" not in message
    assert "hydra.run.dir" in message
    assert not (run_dir / "checkpoints").exists() and not (run_dir / "tb").exists()
    assert (run_dir / LOCK_NAME).read_text() == before and proc.poll() is None  # the first run is undisturbed

    result = run_train([*FAST], run_dir, data_dir)  # the command line: one line and status 1
    assert result.returncode == 1, result.stderr
    assert result.stderr.strip().startswith("error: the run directory") and "Traceback" not in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1
    assert [p.name for p in run_dir.iterdir()] == [LOCK_NAME]  # refused before Hydra wrote .hydra/ or a log


def test_a_lock_whose_process_is_gone_is_taken_over(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead_pid = int(gone.stdout)
    _write_lock(tmp_path, pid=dead_pid, host=socket.gethostname())
    with caplog.at_level(logging.WARNING), RunDirLock(tmp_path) as lock:
        assert json.loads((tmp_path / LOCK_NAME).read_text())["token"] == lock.holder["token"]
    assert f"process {dead_pid} is no longer running" in caplog.text
    assert not (tmp_path / LOCK_NAME).exists()  # released on the way out


def test_a_reused_pid_does_not_keep_a_lock(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    _write_lock(tmp_path, pid=os.getpid(), host=socket.gethostname(), started=time.time() - 10**6)
    with caplog.at_level(logging.WARNING), RunDirLock(tmp_path):
        pass
    assert "its pid was reused" in caplog.text


def test_another_hosts_lock_is_stale_only_after_its_heartbeat_stops(tmp_path: Path, caplog) -> None:
    _write_lock(tmp_path, heartbeat=time.time() - 60)  # a live run on another node of a shared file system
    with pytest.raises(RunError, match="in use by pid 1 on elsewhere"):
        RunDirLock(tmp_path).acquire()
    _write_lock(tmp_path, heartbeat=time.time() - STALE_AFTER_S - 60)
    with caplog.at_level(logging.WARNING), RunDirLock(tmp_path):
        pass
    assert "heartbeat is" in caplog.text


def test_a_requeued_job_takes_over_its_earlier_attempt(tmp_path: Path, monkeypatch, caplog) -> None:
    """SLURM requeues on another node while the dead node's heartbeat is still fresh: the same job id waits
    for that heartbeat to be STALE_AFTER_S old, not more (a live one is refused: test_rundir_races.py)."""
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    monkeypatch.setattr(rundir, "STALE_AFTER_S", 2.0)
    monkeypatch.setattr(rundir, "WAIT_POLL_S", 0.05, raising=False)
    _write_lock(tmp_path, heartbeat=time.time() - 1.5, job="SLURM_JOB_ID=4242")
    started = time.monotonic()
    with caplog.at_level(logging.WARNING), RunDirLock(tmp_path):
        waited = time.monotonic() - started
    assert 0.3 < waited < 5.0, waited  # until the beat was 2 s old: about 0.5 s, not at once
    assert "with this job's id (SLURM_JOB_ID=4242): waiting up to" in caplog.text
    assert "an earlier attempt of this job" in caplog.text
    _write_lock(tmp_path, job="SLURM_JOB_ID=1")  # another job: refused
    with pytest.raises(RunError, match="in use"):
        RunDirLock(tmp_path).acquire()


def test_the_heartbeat_keeps_the_lock_fresh(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(rundir, "HEARTBEAT_S", 0.05)
    with RunDirLock(tmp_path) as lock:
        first = (tmp_path / LOCK_NAME).stat().st_mtime_ns  # the heartbeat is the file's mtime
        time.sleep(0.3)
        assert (tmp_path / LOCK_NAME).stat().st_mtime_ns > first
        assert lock.holder["token"] == json.loads((tmp_path / LOCK_NAME).read_text())["token"]


def test_a_run_directory_that_cannot_be_written_fails_before_training(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real_open = os.open

    def read_only(path, flags, *args):
        if str(path).endswith(LOCK_NAME) and flags & os.O_CREAT:
            raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(path))
        return real_open(path, flags, *args)

    monkeypatch.setattr(os, "open", read_only)
    with pytest.raises(ConfigError) as caught:
        run(compose_cfg(*FAST, output_dir=str(tmp_path / "run")))
    assert "cannot be written (Read-only file system)" in str(caught.value)
    assert not (tmp_path / "run" / "checkpoints").exists()


AHEAD = 100_000_000.0  # another host's clock, three years ahead (or a time set by hand)


def test_a_heartbeat_from_the_future_is_said_to_be_and_never_counts_as_fresh(tmp_path: Path) -> None:
    """Its age is unknown: the lock is not taken over by age, and the line says why instead of a negative age."""
    _write_lock(tmp_path, heartbeat=time.time() + AHEAD)
    with pytest.raises(RunError) as caught:
        RunDirLock(tmp_path).acquire()
    message = str(caught.value)
    assert "heartbeat from the future: the lock file's time is 100000000 s ahead of this host's clock" in message
    assert "s ago" not in message and "\n" not in message and f"delete {tmp_path / LOCK_NAME}" in message
    assert json.loads((tmp_path / LOCK_NAME).read_text())["token"] == "x"  # never taken over


def test_a_requeued_job_counts_a_heartbeat_from_the_future_from_when_it_saw_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The same job on another host, its lock dated in the future: silence for STALE_AFTER_S, seen from here,
    settles it (a holder that beats is refused: test_rundir_races.py). It waited ~3 years before."""
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    monkeypatch.setattr(rundir, "STALE_AFTER_S", 1.0)
    monkeypatch.setattr(rundir, "WAIT_POLL_S", 0.05, raising=False)
    _write_lock(tmp_path, heartbeat=time.time() + AHEAD, job="SLURM_JOB_ID=4242")
    done: list[float] = []

    def take() -> None:
        started = time.monotonic()
        with RunDirLock(tmp_path):
            done.append(time.monotonic() - started)

    with caplog.at_level(logging.WARNING):
        taker = threading.Thread(target=take, daemon=True)  # daemon: a wait of years must not hold pytest
        taker.start()
        taker.join(timeout=20)
    assert done and 0.9 < done[0] < 10, done
    assert "its heartbeat, from the future, has not moved for 1 s" in caplog.text
