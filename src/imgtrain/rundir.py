"""One writer per run directory: a lock file naming its holder, kept fresh by a heartbeat.

Two processes training into one directory would resume from each other's checkpoints and overwrite each
other's files (a SLURM job submitted twice, the same command in a second terminal, a stray process). The
lock is `<run dir>/.imgtrain.lock`, created with O_EXCL (atomic on local disks and on NFSv3 or later) and
holding the pid, host, start time and a heartbeat rewritten every HEARTBEAT_S. A lock is stale, and taken
over with a warning, when its process is gone (same host: the pid no longer runs, or runs a younger
process), when it belongs to an earlier attempt of this same scheduler job (SLURM requeue, torchrun
restart), or when its heartbeat is older than STALE_AFTER_S (another host: its clock must roughly agree).
"""

from __future__ import annotations

import atexit
import contextlib
import json
import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path
from typing import Any

import psutil
from hydra.experimental.callback import Callback
from omegaconf import DictConfig

from imgtrain import dist
from imgtrain.errors import ConfigError, RunEnded, RunError
from imgtrain.host import atomic_write

log = logging.getLogger(__name__)

_HELD: dict[Path, RunDirLock] = {}  # run directories this process holds (python train.py takes its lock early)
LOCK_NAME = ".imgtrain.lock"
HEARTBEAT_S = 30.0  # how often the holder rewrites its heartbeat
STALE_AFTER_S = 300.0  # a heartbeat older than this (seen from another host) means the holder is gone
_JOB_VARIABLES = ("SLURM_JOB_ID", "TORCHELASTIC_RUN_ID")  # the same value in a later attempt of the same job


def _job_id() -> str:
    return "/".join(f"{name}={os.environ[name]}" for name in _JOB_VARIABLES if os.environ.get(name))


def _process_started(pid: int) -> float | None:
    """When process `pid` started (seconds since the epoch), or None if there is no such process."""
    try:
        return psutil.Process(pid).create_time()
    except (psutil.NoSuchProcess, psutil.ZombieProcess):
        return None
    except psutil.AccessDenied:
        return 0.0  # it exists: assume it is the holder


def stale_reason(holder: dict[str, Any], now: float, host: str, job: str) -> str | None:
    """Why the lock `holder` describes may be taken over, or None when its holder may still be writing."""
    if job and holder.get("job") == job:
        return f"it belongs to an earlier attempt of this job ({job})"
    if holder.get("host") == host:
        started = _process_started(int(holder.get("pid", -1)))
        if started is None:
            return f"process {holder.get('pid')} is no longer running"
        if started > float(holder.get("started", 0)) + 1.0:
            return f"process {holder.get('pid')} is no longer the one that took it (its pid was reused)"
        return None
    age = now - float(holder.get("heartbeat", 0))
    if age > STALE_AFTER_S:
        return f"its heartbeat is {age:.0f} s old (more than {STALE_AFTER_S:.0f} s)"
    return None


class RunDirLock:
    """Hold `<directory>/.imgtrain.lock` while training (a context manager); RunError if another run holds it."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.path = directory / LOCK_NAME
        self.holder = {
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "started": time.time(),
            "heartbeat": time.time(),
            "job": _job_id(),
            "token": uuid.uuid4().hex,
        }
        self._stop = threading.Event()
        self._beat: threading.Thread | None = None

    def __enter__(self) -> RunDirLock:
        self.acquire()
        _HELD[self.directory.resolve()] = self
        self._beat = threading.Thread(target=self._heartbeat, name="run-dir-lock", daemon=True)
        self._beat.start()
        return self

    def __exit__(self, *exc: object) -> None:
        """Release the lock (once; later calls do nothing)."""
        if _HELD.get(self.directory.resolve()) is not self:
            return
        del _HELD[self.directory.resolve()]
        self._stop.set()
        if self._beat is not None:
            self._beat.join()
        if self._read().get("token") == self.holder["token"]:
            self.path.unlink(missing_ok=True)

    def acquire(self) -> None:
        """Create the lock file, taking over a stale one; one line saying who holds it otherwise."""
        for _ in range(3):  # another process may take over the same stale lock at the same moment
            try:
                self._create()
                return
            except FileExistsError:
                pass
            except OSError as error:
                raise ConfigError(
                    f"the run directory {self.directory} cannot be written ({error.strerror or error}): pass a "
                    "writable hydra.run.dir (or free space there)"
                ) from None
            holder = self._read()
            reason = stale_reason(holder, time.time(), self.holder["host"], self.holder["job"])
            if reason is None:
                raise RunError(self._held_by(holder))
            log.warning("taking over the lock of %s from pid %s on %s: %s", self.directory, *_who(holder), reason)
            aside = self.path.with_name(f"{LOCK_NAME}.stale.{os.getpid()}")
            with contextlib.suppress(FileNotFoundError):
                os.rename(self.path, aside)  # atomic: of two processes taking over, one moves it, one finds none
                aside.unlink()
        raise RunError(f"could not take the lock {self.path}: other processes keep taking it; is a job looping?")

    def _create(self) -> None:
        self.directory.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            os.write(fd, json.dumps(self.holder).encode())
            os.fsync(fd)
        except OSError:
            os.close(fd)
            self.path.unlink(missing_ok=True)  # a full disk: no half-written lock left behind
            raise
        os.close(fd)

    def _read(self) -> dict[str, Any]:
        """The lock's holder; {} if the file is gone, and an unknown holder if it cannot be parsed."""
        try:
            text = self.path.read_text()
        except FileNotFoundError:
            return {}
        except OSError as error:
            return {"pid": "?", "host": f"? ({error.strerror})", "started": 0, "heartbeat": time.time()}
        try:
            return json.loads(text)
        except json.JSONDecodeError:  # being written this instant, or cut short by a crash: judged by its age
            mtime = self.path.stat().st_mtime if self.path.exists() else 0.0
            return {"pid": "?", "host": "?", "started": mtime, "heartbeat": mtime}

    def _held_by(self, holder: dict[str, Any]) -> str:
        since = datetime.fromtimestamp(float(holder.get("started", 0))).isoformat(sep=" ", timespec="seconds")
        age = time.time() - float(holder.get("heartbeat", 0))
        return (
            f"the run directory {self.directory} is in use by pid {holder.get('pid')} on {holder.get('host')} "
            f"(since {since}, heartbeat {age:.0f} s ago): wait for that run to end or stop it, or pass another "
            f"hydra.run.dir. If that process is surely gone, delete {self.path}"
        )

    def _heartbeat(self) -> None:
        warned = False
        while not self._stop.wait(HEARTBEAT_S):
            if self._read().get("token") != self.holder["token"]:
                if not warned:
                    log.warning("another process has taken the lock %s: two runs may be writing here", self.path)
                    warned = True
                continue
            self.holder["heartbeat"] = time.time()
            text = json.dumps(self.holder).encode()
            with contextlib.suppress(OSError):  # a full disk must not end the run here; the checkpoint says so
                atomic_write(self.path, lambda f, data=text: f.write(data))


def _who(holder: dict[str, Any]) -> tuple[Any, Any]:
    return holder.get("pid"), holder.get("host")


@contextlib.contextmanager
def hold(directory: Path, info: dist.DistInfo) -> Iterator[None]:
    """Rank 0 holds the run directory's lock for the whole job; every rank stops if it cannot. Nothing to do
    when this process holds it already (`LockRunDir` took it before Hydra wrote there)."""
    held = directory.resolve() in _HELD
    lock = RunDirLock(directory) if info.is_main and not held else None
    problem: RunError | None = None
    if lock is not None:
        try:
            lock.__enter__()
        except RunError as error:  # ConfigError too
            problem = error
    problem = dist.broadcast_object(problem, info)  # rank 0's refusal (it pickles), raised on every rank
    if problem is not None:
        raise problem
    try:
        yield
    finally:
        if lock is not None:
            lock.__exit__()


class LockRunDir(Callback):
    """Hydra callback: `python train.py` takes the run directory's lock before Hydra writes `.hydra/` and the log
    file there, so a refused second run leaves the directory exactly as it was (rank 0; a multirun's jobs lock
    their own directories in `run`)."""

    def on_run_start(self, config: DictConfig, **kwargs: Any) -> None:
        if os.environ.get("RANK", "0") != "0":
            return
        try:
            directory = Path(str(config.hydra.run.dir)).resolve()
        except Exception:  # noqa: BLE001 - a run dir built from values known only later: `run` locks it then
            return
        lock = RunDirLock(directory)
        try:
            lock.__enter__()
        except RunError as error:  # ConfigError too
            raise RunEnded.from_error(error, str(error)) from error  # Hydra turns an Exception into a warning
        atexit.register(lock.__exit__)  # also after a stop signal, which ends the process past on_run_end

    def on_run_end(self, config: DictConfig, **kwargs: Any) -> None:
        for lock in list(_HELD.values()):
            lock.__exit__()
