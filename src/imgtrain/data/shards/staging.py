"""The converter's stops and its staging folder.

A conversion stages files on this machine (the unreadable-image reports of LitData's workers and, for object
storage, every chunk before it is uploaded: up to one 64 MB shard per worker). It is removed on every stop:
the end, an error, Ctrl-C, SIGTERM and SIGHUP (each unwinds the converter like Ctrl-C, see `stops`). SIGKILL runs
no code, so the folder has a fixed name per destination, printed when it is made, and the next conversion into
the same destination (the command that resumes it) removes what a killed one left there first.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import multiprocessing
import os
import shutil
import signal
import stat
import tempfile
from collections.abc import Iterator

from imgtrain.common.errors import ConfigError

PREFIX = "imgtrain-shards-"
LOCK = ".lock"  # held while a conversion uses the folder: the next one knows whether it is left over
STOP_SIGNALS = (signal.SIGTERM, signal.SIGHUP)  # SIGINT already raises KeyboardInterrupt (engine.py keeps it so)


class Stopped(KeyboardInterrupt):
    """A stop signal in the converter's main process, raised like Ctrl-C's KeyboardInterrupt, so that every
    `finally` runs and LitData's own `except Exception` does not swallow it."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


@contextlib.contextmanager
def stops() -> Iterator[None]:
    """SIGTERM and SIGHUP raise `Stopped` in this process while the conversion runs (by default they end it on the
    spot, leaving the staging folder). A worker process forked meanwhile inherits the handler and ends at once:
    the main process stops the others and cleans up."""

    def stop(signum: int, frame: object) -> None:
        if multiprocessing.parent_process() is not None:
            os._exit(128 + signum)
        raise Stopped(signum)

    saved = {signum: signal.signal(signum, stop) for signum in STOP_SIGNALS}
    try:
        yield
    finally:
        for signum, handler in saved.items():
            signal.signal(signum, handler)


def folder_for(destination: str, endpoint: str = "") -> str:
    """The staging folder of a conversion into `destination`: the same for every run of the same command (so the
    next one finds a killed one's), another for another destination, object store (`endpoint`) or user."""
    digest = hashlib.sha256(f"{endpoint} {destination}".encode()).hexdigest()[:16]
    return os.path.join(tempfile.gettempdir(), f"{PREFIX}{os.getuid()}-{digest}")


def _check_own(folder: str) -> None:
    """The folder's name is predictable, and a shared temporary directory lets anyone make it first: use it only if
    it is a real directory (not a link) of this user, closed to others, since what is left in it gets deleted."""
    info = os.lstat(folder)
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid() or info.st_mode & 0o077:
        raise ConfigError(
            f"the staging folder {folder} is not a private directory of this user (a link, another owner, or open to "
            "others): remove it, or set TMPDIR to a directory of your own"
        )


@contextlib.contextmanager
def staging(destination: str, endpoint: str = "") -> Iterator[str]:
    """The staging folder for `destination` on `endpoint`'s store (s3://b/x on two stores is two datasets),
    emptied of what a killed conversion left, removed when this one ends however it ends (bar SIGKILL); one line
    when another conversion into the same destination is using it."""
    folder = folder_for(destination, endpoint)
    os.makedirs(folder, mode=0o700, exist_ok=True)
    _check_own(folder)
    with open(os.path.join(folder, LOCK), "a") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)  # released by the kernel however the holder ends
        except BlockingIOError:
            raise ConfigError(
                f"DST={destination}: another imgtrain-shards is converting into it (its staging folder {folder} is "
                "in use): wait for it to end, or stop it"
            ) from None
        left = [name for name in os.listdir(folder) if name != LOCK]
        for name in left:  # a killed conversion's
            shutil.rmtree(os.path.join(folder, name), ignore_errors=True)
        note = f", after removing what a killed conversion left there ({len(left)} item(s))" if left else ""
        print(f"staging in {folder} (removed when the conversion ends{note})", flush=True)
        try:
            yield folder
        finally:
            shutil.rmtree(folder, ignore_errors=True)
