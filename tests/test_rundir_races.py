"""The run directory's lock under pressure (issue 30): a live holder with this job's id, malformed lock files,
and the races of two processes taking over one stale lock, each competitor injected at the exact point."""

from __future__ import annotations

import errno
import json
import logging
import os
import socket
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from imgtrain.common.errors import ConfigError, RunError
from imgtrain.resilience import rundir
from imgtrain.resilience.rundir import LOCK_NAME, STALE_AFTER_S, RunDirLock


def _dead_pid() -> int:
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    return int(gone.stdout)


def _write_lock(run_dir: Path, text: str | bytes, age: float = 0.0) -> Path:
    """A lock file holding `text`, its heartbeat (mtime) `age` seconds old."""
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / LOCK_NAME
    path.write_bytes(text if isinstance(text, bytes) else text.encode())
    beat = time.time() - age
    os.utime(path, (beat, beat))
    return path


def _stale_lock(run_dir: Path) -> Path:
    """A lock left on this host by a process that is gone: every process may take it over."""
    holder = {"pid": _dead_pid(), "host": socket.gethostname(), "started": 0.0, "job": "", "token": "stale"}
    return _write_lock(run_dir, json.dumps(holder))


def _token(run_dir: Path) -> str:
    return json.loads((run_dir / LOCK_NAME).read_text())["token"]


def _once(real: Callable, before: Callable[..., None]) -> Callable:
    """`real`, but the first call runs `before(*args)` first: a competitor at that exact point."""
    calls = []

    def patched(*args, **kwargs):
        if not calls:
            calls.append(args)
            before(*args)
        return real(*args, **kwargs)

    return patched


@pytest.mark.parametrize("variable, value", [("TORCHELASTIC_RUN_ID", "none"), ("SLURM_JOB_ID", "77")])
def test_a_live_run_with_the_same_job_id_is_refused(tmp_path: Path, monkeypatch, variable: str, value: str) -> None:
    """torchrun's default rendezvous id is `none` for every job; two runs in one salloc share SLURM_JOB_ID."""
    for name in ("TORCHELASTIC_RUN_ID", "SLURM_JOB_ID"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv(variable, value)
    script = f"""
        import pathlib, time
        from imgtrain.resilience.rundir import RunDirLock
        with RunDirLock(pathlib.Path({str(tmp_path)!r})):
            print("locked", flush=True)
            time.sleep(600)
    """
    proc = subprocess.Popen([sys.executable, "-c", textwrap.dedent(script)], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "locked"
        before = (tmp_path / LOCK_NAME).read_text()
        with pytest.raises(RunError, match=f"in use by pid {proc.pid} on "):
            RunDirLock(tmp_path).acquire()
        assert (tmp_path / LOCK_NAME).read_text() == before and proc.poll() is None
    finally:
        proc.kill()
        proc.wait(timeout=30)


def test_a_restarted_worker_takes_over_from_its_dead_predecessor(tmp_path: Path, monkeypatch, caplog) -> None:
    """torchrun --max-restarts: the same job id on the same host, and the old worker's process is gone."""
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "none")
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    dead = _dead_pid()
    holder = {"pid": dead, "host": socket.gethostname(), "started": time.time(), "job": "TORCHELASTIC_RUN_ID=none"}
    _write_lock(tmp_path, json.dumps(holder))
    with caplog.at_level(logging.WARNING), RunDirLock(tmp_path):
        pass
    assert f"process {dead} (an earlier attempt of this job) is no longer running" in caplog.text


def test_a_holder_of_the_same_job_on_another_host_that_beats_is_refused(tmp_path: Path, monkeypatch) -> None:
    """Not taken over, and not after waiting STALE_AFTER_S either: its first beat settles it."""
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    monkeypatch.setattr(rundir, "WAIT_POLL_S", 0.01, raising=False)
    holder = {"pid": 1, "host": "elsewhere", "started": 0.0, "job": "SLURM_JOB_ID=4242", "token": "other"}
    lock = _write_lock(tmp_path, json.dumps(holder), age=10.0)
    beats = []

    def sleep_while_it_beats(seconds: float) -> None:  # the holder's heartbeat, during the first poll
        beats.append(seconds)
        os.utime(lock)

    monkeypatch.setattr(rundir.time, "sleep", sleep_while_it_beats)
    with pytest.raises(RunError, match="in use by pid 1 on elsewhere"):
        RunDirLock(tmp_path).acquire()
    assert len(beats) == 1 and _token(tmp_path) == "other"


HERE = json.dumps({"pid": "abc", "host": socket.gethostname(), "started": 0})  # int("abc") was a ValueError
BEYOND = '{"pid": 1, "host": "h", "started": 1e300}'  # datetime.fromtimestamp raised OverflowError
MALFORMED = ["null", "[]", '{"pid": "abc"}', HERE, '{"pid": -1, "host": "h", "started": 0}', '{"pid": 1}', BEYOND]
MALFORMED += [b"\xff{", "", pytest.param("[" * 100_000, id="nested-100000-deep")]  # Python's parser: RecursionError


@pytest.mark.parametrize("text", MALFORMED)
def test_a_malformed_lock_is_an_unknown_holder_judged_by_its_age(tmp_path: Path, caplog, text) -> None:
    _write_lock(tmp_path, text)  # fresh: perhaps being written this instant
    with pytest.raises(RunError) as caught:
        RunDirLock(tmp_path).acquire()
    assert "is in use by pid ? on ?" in str(caught.value) and "\n" not in str(caught.value)
    _write_lock(tmp_path, text, age=STALE_AFTER_S + 60)
    with caplog.at_level(logging.WARNING), RunDirLock(tmp_path) as taken:
        assert _token(tmp_path) == taken.holder["token"]
    assert "its heartbeat is" in caplog.text


def test_an_unparseable_lock_dated_past_year_9999_is_one_line(tmp_path: Path) -> None:
    """Its start is its mtime, which anyone may set (tmpfs keeps 3e11 s; ext4 clamps to 2446): the holder
    `_look` makes of such a file, too far for datetime.fromtimestamp to print."""
    unknown = {"pid": "?", "host": "?", "started": 3e11, "heartbeat": 3e11}
    message = RunDirLock(tmp_path)._held_by(unknown)
    assert "in use by pid ? on ? (since an unknown time, heartbeat" in message and "\n" not in message


def test_a_directory_at_the_lock_path_is_one_line(tmp_path: Path) -> None:
    (tmp_path / LOCK_NAME).mkdir()
    with pytest.raises(RunError, match=r"in use by pid \? on \? \(Is a directory\)"):
        RunDirLock(tmp_path).acquire()


def test_a_stale_lock_that_cannot_be_moved_is_one_line(tmp_path: Path, monkeypatch) -> None:
    """Another user's run directory, or an immutable one (chattr +i refuses even root): the rename fails."""
    _stale_lock(tmp_path)

    def refused(source, target) -> None:
        raise PermissionError(errno.EPERM, os.strerror(errno.EPERM), str(source))

    monkeypatch.setattr(os, "rename", refused)
    with pytest.raises(ConfigError, match=r"cannot be written \(Operation not permitted\)") as caught:
        RunDirLock(tmp_path).acquire()
    assert "\n" not in str(caught.value)


def test_a_takeover_never_moves_aside_the_lock_a_faster_process_just_took(tmp_path: Path, monkeypatch) -> None:
    """Both judge the same stale lock; the faster one takes it between the slower one's read and rename."""
    _stale_lock(tmp_path)
    faster, slower = RunDirLock(tmp_path), RunDirLock(tmp_path)
    monkeypatch.setattr(os, "rename", _once(os.rename, lambda *_: faster.acquire()))
    with pytest.raises(RunError, match=f"in use by pid {os.getpid()}"):
        slower.acquire()
    assert _token(tmp_path) == faster.holder["token"]  # the faster one's lock, in place
    assert [p.name for p in tmp_path.iterdir()] == [LOCK_NAME]  # nothing left aside


def test_a_holder_that_beats_before_the_rename_keeps_its_lock(tmp_path: Path, monkeypatch) -> None:
    """Judged stale by its old heartbeat, it beats (a hung node recovering) just before the rename."""
    holder = {"pid": 1, "host": "elsewhere", "started": 0.0, "job": "", "token": "revived"}
    lock = _write_lock(tmp_path, json.dumps(holder), age=STALE_AFTER_S + 60)
    monkeypatch.setattr(os, "rename", _once(os.rename, lambda *_: os.utime(lock)))
    with pytest.raises(RunError, match="in use by pid 1 on elsewhere"):
        RunDirLock(tmp_path).acquire()
    assert _token(tmp_path) == "revived" and time.time() - lock.stat().st_mtime < 60


def test_a_lock_created_while_another_was_moved_aside_is_never_replaced(tmp_path: Path, monkeypatch) -> None:
    """Three at once: the faster takes it over, the slower moves that aside by mistake, and a third creates one
    at the empty path before it is put back. No lock is overwritten; the slower says so in one line."""
    _stale_lock(tmp_path)
    faster, slower, third = RunDirLock(tmp_path), RunDirLock(tmp_path), RunDirLock(tmp_path)
    monkeypatch.setattr(os, "rename", _once(os.rename, lambda *_: faster.acquire()))
    monkeypatch.setattr(os, "link", _once(os.link, lambda *_: third.acquire()))
    with pytest.raises(RunError, match="changed hands while this run was taking it over") as caught:
        slower.acquire()
    assert "\n" not in str(caught.value)
    assert _token(tmp_path) == third.holder["token"]
    assert [p.name for p in tmp_path.iterdir()] == [LOCK_NAME]


class _OneBeat:
    """A stop event that lets the heartbeat loop run exactly once."""

    def __init__(self) -> None:
        self.waits = 0

    def wait(self, timeout: float) -> bool:
        self.waits += 1
        return self.waits > 1


def test_the_heartbeat_never_overwrites_the_lock_of_a_process_that_took_over(
    tmp_path: Path, monkeypatch, caplog
) -> None:
    """A holder judged stale (a hung node) resumes: its next heartbeat must leave the successor's lock alone.
    The successor takes over at the very moment the heartbeat writes (whatever call it writes with)."""
    hung, successor = RunDirLock(tmp_path), RunDirLock(tmp_path)
    hung.acquire()
    real_rename = os.rename

    def take_over(*_: object) -> None:
        aside = tmp_path / "aside"
        real_rename(tmp_path / LOCK_NAME, aside)
        aside.unlink()
        successor.acquire()

    monkeypatch.setattr(os, "utime", _once(os.utime, take_over))
    monkeypatch.setattr(os, "replace", _once(os.replace, take_over))
    monkeypatch.setattr(hung, "_stop", _OneBeat())
    with caplog.at_level(logging.WARNING):
        hung._heartbeat()
    assert _token(tmp_path) == successor.holder["token"]
    assert "another process has taken the lock" in caplog.text
