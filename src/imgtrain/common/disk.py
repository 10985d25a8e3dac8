"""A full disk, said in one line: which disk (its mount point and device) and how much is free on it.

The OSError a full disk raises names a file and "[Errno 28] No space left on device", and some writers lose even
that (torch.save says "unexpected pos"); what a user needs is which disk to clear, and how full it is now.
"""

from __future__ import annotations

import errno
import logging
import os
import shutil
import sys
from pathlib import Path

import psutil

FULL = {errno.ENOSPC: "No space left on device", errno.EDQUOT: "Disk quota exceeded"}  # this user's quota


def _full(error: BaseException | None) -> int | None:
    """The errno of the full disk or quota behind `error` (itself, or what it was raised from or while handling)."""
    seen: set[int] = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        if isinstance(error, OSError) and error.errno in FULL:
            return error.errno
        error = error.__cause__ or error.__context__
    return None


def is_disk_full(error: BaseException) -> bool:
    """Whether `error`, or an error it was raised from or while handling, is a full disk or quota."""
    return _full(error) is not None


def _mount_point(path: Path) -> Path:
    """The mount point of the file system that holds `path`, or would hold it (the nearest existing folder up)."""
    path = Path(os.path.abspath(path))
    while not path.exists() and path != path.parent:
        path = path.parent
    path = path.resolve()  # the disk a link of the run's own user leads to
    while not os.path.ismount(path):
        path = path.parent
    return path


def _device(mount: Path) -> str | None:
    """The device (or file system type, for tmpfs and the like) mounted at `mount`: the last mount there wins."""
    found = None
    try:
        for part in psutil.disk_partitions(all=True):
            if part.mountpoint == str(mount):
                found = part.device if part.device not in ("", "none", part.fstype) else part.fstype
    except OSError:
        return None
    return found


def _size(count: float) -> str:
    if count < 1024:
        return f"{count:.0f} bytes"
    for unit in ("KiB", "MiB", "GiB"):
        count /= 1024
        if count < 1024:
            return f"{count:.1f} {unit}"
    return f"{count / 1024:.1f} TiB"


def disk_full_line(path: str | os.PathLike[str], error: BaseException | None = None) -> str:
    """The line for a full disk under `path`: "No space left on device on <mount> (<device>, <free> free of
    <size>)" ("Disk quota exceeded on ..." when `error` is a full quota), for a message such as
    f"{path} could not be written: {disk_full_line(path, error)}". Free is what this user may still write."""
    mount = _mount_point(Path(path))
    device = _device(mount)
    what = FULL.get(_full(error) or errno.ENOSPC)
    try:
        usage = shutil.disk_usage(mount)
    except OSError:
        return f"{what} on {mount}" + (f" ({device})" if device else "")
    where = f"{device}, " if device else ""
    return f"{what} on {mount} ({where}{_size(usage.free)} free of {_size(usage.total)})"


class LogFile(logging.FileHandler):
    """The run's log file (train.log; conf/hydra/job_logging names this class). On a full disk it says so once, in
    one line on the console, and writes no more: logging's own `handleError` prints a traceback to stderr for every
    line logged after, which buried the run's one-line error under hundreds of lines."""

    full = False  # set on the handler once its disk is full

    def emit(self, record: logging.LogRecord) -> None:
        if not self.full:
            super().emit(record)

    def handleError(self, record: logging.LogRecord) -> None:  # noqa: N802 - logging's name
        error = sys.exc_info()[1]
        if error is None or not is_disk_full(error):
            super().handleError(record)
            return
        self.full = True  # this line goes to the console (stdout); here it is dropped, by `emit`
        logging.getLogger(__name__).warning(
            "%s cannot be written: %s; the log goes on on the console only",
            self.baseFilename,
            disk_full_line(self.baseFilename, error),
        )
