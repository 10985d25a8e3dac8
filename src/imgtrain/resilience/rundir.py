"""One writer per run directory: a lock file naming its holder, kept fresh by a heartbeat.

Two processes training into one directory would resume from each other's checkpoints and overwrite each other's
files (a Slurm job submitted twice, the same command in a second terminal, a stray process). The lock is
`<run dir>/.imgtrain.lock`, created with O_EXCL (atomic on local disks and NFSv3+): pid, host, start time, job id and
a random token; its mtime is the heartbeat, touched every HEARTBEAT_S. It is taken over, with a warning, once its
process is gone (same host: the pid no longer runs, or runs a younger process) or its heartbeat is older than
STALE_AFTER_S (another host: a heartbeat from the future has an unknown age, see `lockfile.look`). A shared job id
proves nothing (`stale_reason`); a takeover moves only the very file it judged stale (`RunDirLock._remove_if`).
Before any of it, a link another user planted at the run directory or a name Hydra writes there is refused.
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

from imgtrain.common.errors import ConfigError, RunEnded, RunError
from imgtrain.common.links import refuse_foreign_links
from imgtrain.host import dist
from imgtrain.resilience.lockfile import Seen, ahead, look, who

log = logging.getLogger(__name__)

_HELD: dict[Path, RunDirLock] = {}  # run directories this process holds (python train.py takes its lock early)
LOCK_NAME = ".imgtrain.lock"
HEARTBEAT_S = 30.0  # how often the holder touches the lock file (its mtime is the heartbeat)
STALE_AFTER_S = 300.0  # a heartbeat older than this (seen from another host) means the holder is gone
WAIT_POLL_S = 5.0  # how often a run waiting on its own job's earlier attempt looks at that one's heartbeat
_JOB_VARIABLES = ("SLURM_JOB_ID", "TORCHELASTIC_RUN_ID")  # the same value in a later attempt of the same job


def job_id() -> str:
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
    """Why the lock `holder` describes may be taken over, or None when its holder may still be writing.

    The same job id alone never says so: torchrun's default rendezvous id is `none`, shared by unrelated jobs,
    and two runs in one `salloc` share SLURM_JOB_ID. On this host the pid decides (a restarted attempt's old
    worker is dead); from another host see `RunDirLock._wait_for_heartbeat`."""
    if holder.get("host") == host:
        pid, earlier = holder["pid"], " (an earlier attempt of this job)" if job and holder.get("job") == job else ""
        started = _process_started(pid)
        if started is None:
            return f"process {pid}{earlier} is no longer running"
        if started > holder["started"] + 1.0:
            return f"process {pid} is no longer the one that took it (its pid was reused)"
        return None
    age = now - holder["heartbeat"]
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
            "job": job_id(),
            "token": uuid.uuid4().hex,
        }
        self._fd: int | None = None  # the lock file this process created, open for the heartbeat
        self._written = b""
        self._stop = threading.Event()
        self._beat: threading.Thread | None = None

    def __enter__(self) -> RunDirLock:
        self.acquire()
        _HELD[self.directory.resolve()] = self
        self._beat = threading.Thread(target=self._heartbeat, name="run-dir-lock", daemon=True)
        self._beat.start()
        return self

    def __exit__(self, *exc: object) -> None:
        """Release the lock (once; later calls do nothing): remove the file only if it is still this one."""
        if _HELD.get(self.directory.resolve()) is not self:
            return
        del _HELD[self.directory.resolve()]
        self._stop.set()
        if self._beat is not None:
            self._beat.join()
        fd, self._fd = self._fd, None
        if fd is None:
            return
        try:
            info = os.fstat(fd)
            os.close(fd)
            self._remove_if((info.st_dev, info.st_ino, info.st_mtime_ns, self._written))
        except (RunError, OSError) as error:  # leaving: say it, but the run's own outcome stands
            log.warning("could not release the lock %s: %s", self.path, error)

    def acquire(self) -> None:
        """Create the lock file, taking over a stale one; one line saying who holds it otherwise."""
        for _ in range(3):  # another process may take over the same stale lock at the same moment
            try:
                self._create()
                return
            except FileExistsError:
                pass
            except OSError as error:
                raise self._unwritable(error) from None
            seen = look(self.path)
            if not seen.holder:
                continue  # released since: create it again
            reason = stale_reason(seen.holder, time.time(), self.holder["host"], self.holder["job"])
            if reason is None and self._same_job_elsewhere(seen.holder):
                reason = self._wait_for_heartbeat(seen)
                if reason is None:
                    continue  # released or taken by another process meanwhile: look again
            if reason is None:
                raise RunError(self._held_by(seen.holder))
            log.warning("taking over the lock of %s from pid %s on %s: %s", self.directory, *who(seen.holder), reason)
            try:
                self._remove_if(seen.identity)  # False: it was not the stale file (any more); the next round says who
            except OSError as error:  # a directory of another user's, or immutable: the lock cannot be moved
                raise self._unwritable(error) from None
        raise RunError(f"could not take the lock {self.path}: other processes keep taking it; is a job looping?")

    def _unwritable(self, error: OSError) -> ConfigError:
        return ConfigError(
            f"the run directory {self.directory} cannot be written ({error.strerror or error}): pass a writable "
            "hydra.run.dir (or free space there)"
        )

    def _same_job_elsewhere(self, holder: dict[str, Any]) -> bool:
        job = self.holder["job"]
        return bool(job) and holder.get("job") == job and holder.get("host") != self.holder["host"]

    def _wait_for_heartbeat(self, seen: Seen) -> str | None:
        """A live-looking holder of this job on another host: an earlier attempt (requeued from a node that died,
        its heartbeat stopped but not STALE_AFTER_S old yet) or a second run of the job (its heartbeat goes on).
        A beat refuses (RunError, within about HEARTBEAT_S); silence until STALE_AFTER_S gives the reason to take
        over. None when the file was released or replaced meanwhile (a clean stop leaves no lock at all)."""
        log.warning(
            "the lock of %s is held by pid %s on %s with this job's id (%s): waiting up to %.0f s to see whether "
            "its heartbeat has stopped (an earlier attempt of this job) or goes on (another run: refused)",
            self.directory,
            *who(seen.holder),
            self.holder["job"],
            STALE_AFTER_S - (time.time() - seen.holder["heartbeat"]),
        )
        while (age := time.time() - seen.holder["heartbeat"]) <= STALE_AFTER_S:
            time.sleep(min(WAIT_POLL_S, STALE_AFTER_S - age + 0.01))
            latest = look(self.path)
            if latest.identity is None or latest.identity[:2] != seen.identity[:2]:
                return None
            if latest.identity != seen.identity:  # the same file, touched: its holder runs
                raise RunError(self._held_by(latest.holder))
        earlier = f"it belongs to an earlier attempt of this job ({self.holder['job']})"
        if seen.holder.get("ahead"):  # its age is unknown: how long it has been seen still is what counts
            return f"{earlier}: its heartbeat, from the future, has not moved for {age:.0f} s"
        return f"{earlier}: its heartbeat is {age:.0f} s old"

    def _remove_if(self, identity: tuple[int, int, int, bytes] | None) -> bool:
        """Remove the lock file only if it is still exactly `identity`; True if it is gone. There is no
        unlink-if-unchanged, so: rename it to a name of this process's own (atomic: of two processes, each gets a
        different file, or none), look at what was moved, and put back what is not it (a lock that a faster
        process created after taking over the same stale one, or a holder that beat)."""
        aside = self.path.with_name(f"{LOCK_NAME}.stale.{self.holder['token']}")
        try:
            os.rename(self.path, aside)
        except FileNotFoundError:
            return True
        if identity is not None and look(aside).identity == identity:
            aside.unlink(missing_ok=True)
            return True
        self._put_back(aside)
        return False

    def _put_back(self, aside: Path) -> None:
        """Return a lock file moved aside by mistake, without replacing one created at the path meanwhile."""
        try:
            os.link(aside, self.path)  # fails if the path exists, where a rename would replace it
        except FileExistsError:
            moved, now = look(aside).holder, look(self.path).holder
            aside.unlink(missing_ok=True)
            raise RunError(
                f"the lock {self.path} changed hands while this run was taking it over: pid {moved.get('pid')} on "
                f"{moved.get('host')} and pid {now.get('pid')} on {now.get('host')} may both write; stop one"
            ) from None
        except OSError:  # a file system without hard links: the same, but checked first (a narrow window)
            if not self.path.exists():
                os.rename(aside, self.path)
            return
        aside.unlink(missing_ok=True)

    def _create(self) -> None:
        self.directory.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        data = json.dumps(self.holder).encode()
        try:
            os.write(fd, data)
            os.fsync(fd)
        except OSError:
            os.close(fd)
            self.path.unlink(missing_ok=True)  # a full disk: no half-written lock left behind
            raise
        self._fd, self._written = fd, data

    def _held_by(self, holder: dict[str, Any]) -> str:
        try:  # an unparseable lock's start is its mtime, which anyone may set to any time
            since = datetime.fromtimestamp(holder.get("started", 0)).isoformat(sep=" ", timespec="seconds")
        except (OverflowError, ValueError, OSError, TypeError):
            since = "an unknown time"
        now = time.time()
        future = ahead(holder, now)
        beat = (
            f"heartbeat from the future: the lock file's time is {future:.0f} s ahead of this host's clock (that "
            "host's clock is ahead, or the time was set by hand), so its age cannot tell whether that run is gone"
            if future
            else f"heartbeat {now - float(holder.get('heartbeat', 0)):.0f} s ago"
        )
        return (
            f"the run directory {self.directory} is in use by pid {holder.get('pid')} on {holder.get('host')} "
            f"(since {since}, {beat}): wait for that run to end or stop it, or pass another hydra.run.dir. If that "
            f"process is surely gone, delete {self.path}"
        )

    def _heartbeat(self) -> None:
        """Every HEARTBEAT_S, touch the lock file's mtime through the descriptor it was created with: never
        another holder's file, which a rewrite by path (read, check, replace) could overwrite after a takeover."""
        warned = False
        while not self._stop.wait(HEARTBEAT_S):
            with contextlib.suppress(OSError):  # ESTALE once another host removed it: the check below says so
                os.utime(self._fd)
            if not warned and not self._still_held():
                log.warning("another process has taken the lock %s: two runs may be writing here", self.path)
                warned = True

    def _still_held(self) -> bool:
        try:
            mine, there = os.fstat(self._fd), os.stat(self.path, follow_symlinks=False)
        except OSError:
            return False
        return (mine.st_dev, mine.st_ino) == (there.st_dev, there.st_ino)


@contextlib.contextmanager
def hold(directory: Path, info: dist.DistInfo) -> Iterator[None]:
    """Rank 0 holds the run directory's lock for the whole job; every rank stops if it cannot. Nothing to do
    when this process holds it already (`LockRunDir` took it before Hydra wrote there)."""
    held = directory.resolve() in _HELD
    lock = RunDirLock(directory) if info.is_main and not held else None
    problem: RunError | None = None
    if lock is not None:
        try:
            refuse_foreign_links(directory)  # the run directory itself a link another user planted
            lock.__enter__()
        except RunError as error:  # ConfigError too
            problem = error
    refusal = dist.broadcast_plain(None if problem is None else [isinstance(problem, ConfigError), str(problem)], info)
    if refusal is not None:  # rank 0's refusal, raised on every rank
        raise problem if problem is not None else (ConfigError if refusal[0] else RunError)(refusal[1])
    try:
        yield
    finally:
        if lock is not None:
            lock.__exit__()


def _hydra_files(config: DictConfig) -> list[str]:
    """What Hydra writes in a job's directory before any task code runs (`run_job`): the log file, opened by
    `configure_log` (conf/hydra/job_logging names it after the job), and `.hydra/`'s three files."""
    subdir = config.hydra.output_subdir  # `.hydra` on rank 0, None elsewhere
    saved = [f"{subdir}/{name}.yaml" for name in ("config", "hydra", "overrides")] if subdir else []
    return [f"{config.hydra.job.name}.log", *saved]


def lock_before_hydra(config: DictConfig, directory: Path) -> RunDirLock:
    """Refuse another user's links at `directory` and the names Hydra writes there and take its lock, before Hydra
    writes them (rank 0): a refused run leaves the directory as it was, ending in one line (RunEnded)."""
    try:
        refuse_foreign_links(directory, *_hydra_files(config))  # before resolving: the directory may be one
        lock = RunDirLock(directory.resolve())
        lock.__enter__()
    except RunError as error:  # ConfigError too
        raise RunEnded.from_error(error, str(error)) from error  # Hydra turns an Exception into a warning
    return lock


class LockRunDir(Callback):
    """Hydra callback, the first one: `python train.py` locks its run directory before Hydra writes there. A multirun's
    jobs lock theirs in `run` (hydra/launcher=slurm: before Hydra writes, src/hydra_plugins/imgtrain_slurm), with no
    callback before Hydra writes them: the sweep directory is checked as the sweep starts."""

    def on_run_start(self, config: DictConfig, **kwargs: Any) -> None:
        if os.environ.get("RANK", "0") != "0":
            return
        try:
            directory = Path(str(config.hydra.run.dir))
        except Exception:  # noqa: BLE001 - a run dir built from values known only later: `run` locks it then
            return
        lock = lock_before_hydra(config, directory)
        atexit.register(lock.__exit__)  # also after a stop signal, which ends the process past on_run_end

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        """The sweep directory, each job directory already in it (a sweep continued, or planted ahead) and what
        Hydra writes in them."""
        if os.environ.get("RANK", "0") != "0":
            return
        try:
            sweep = Path(str(config.hydra.sweep.dir))
        except Exception:  # noqa: BLE001 - built from values known only later: Hydra says so
            return
        try:
            jobs = sorted(entry.name for entry in sweep.iterdir()) if sweep.is_dir() else []
        except OSError:  # unreadable: Hydra's own write there says why
            jobs = []
        inside = [f"{job}/{name}" for job in jobs for name in _hydra_files(config)]
        try:
            refuse_foreign_links(sweep, *jobs, *inside, key="hydra.sweep.dir")
        except RunError as error:
            raise RunEnded.from_error(error, str(error)) from error  # Hydra turns an Exception into a warning

    def on_run_end(self, config: DictConfig, **kwargs: Any) -> None:
        for lock in list(_HELD.values()):
            lock.__exit__()
