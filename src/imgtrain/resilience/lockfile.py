"""The run directory's lock file as read: its holder, its heartbeat, and what tells this very file apart from any
later one (`rundir.RunDirLock` decides what to do with it).

Anyone who can write the run directory can write the lock file, so nothing in it is trusted: content this code did
not write (not JSON, nested too deeply to parse, a pid "abc") is an unknown holder, and a heartbeat (the file's
mtime) ahead of this host's clock has an unknown age (another host's clock is ahead, or the time was set by hand).
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from imgtrain.common.atomic import BadJSON, read_json

# A heartbeat this far ahead of this host's clock is from the future: hosts kept in time by NTP, and a file system's
# timestamps, agree far better. Closer than that, it is taken as now.
CLOCK_SLACK_S = 2.0


@dataclass(frozen=True)
class Seen:
    """The lock file as read once: its holder, and what tells this very file apart from any later one."""

    holder: dict[str, Any]  # {} when there is no lock file
    identity: tuple[int, int, int, bytes] | None  # st_dev, st_ino, st_mtime_ns, content; None: none or unreadable


def well_formed(holder: Any) -> bool:
    """Whether `holder` is a lock this code wrote: anything else (`null`, `[]`, a pid "abc") is judged by age."""
    if not isinstance(holder, dict):
        return False
    pid, host, started = holder.get("pid"), holder.get("host"), holder.get("started")
    return (
        type(pid) is int
        and 0 < pid < 2**32
        and isinstance(host, str)
        and type(started) in (int, float)
        and 0 <= started < 1e10  # seconds since the epoch, before 2286: NaN, inf and 1e300 are not start times
        and all(isinstance(holder.get(key, ""), str) for key in ("job", "token"))
    )


def look(path: Path) -> Seen:
    """The lock file at `path`. Its heartbeat is its mtime (see `RunDirLock._heartbeat`); one it cannot parse,
    being written this instant or cut short by a crash or not ours, has an unknown holder judged by that age.

    A heartbeat from the future (more than CLOCK_SLACK_S ahead) has an unknown age: it counts from now, when it
    was seen (so it is never stale at first sight, and a wait for it to go stale watches it from here), and
    `ahead` says by how much it is ahead, for the line that names the holder."""
    flags = getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0)  # a planted link or fifo: no further
    try:  # opened, not just stat'ed: NFS revalidates a file's attributes on open (close-to-open consistency)
        with open(path, "rb", opener=lambda name, mode: os.open(name, mode | flags)) as file:
            info = os.fstat(file.fileno())
            raw = file.read(1 << 16)
    except FileNotFoundError:
        return Seen({}, None)
    except OSError as error:  # a directory there, a link, a stale NFS handle: unknown, and live for now
        return Seen({"pid": "?", "host": f"? ({error.strerror})", "started": 0, "heartbeat": time.time()}, None)
    try:
        holder = read_json(raw, str(path))
    except BadJSON:  # not JSON, not UTF-8, nested 100,000 deep: an unknown holder
        holder = None
    if not well_formed(holder):
        holder = {"pid": "?", "host": "?", "started": info.st_mtime}
    now = time.time()
    future = info.st_mtime - now if info.st_mtime - now > CLOCK_SLACK_S else None
    beat = {"heartbeat": min(info.st_mtime, now), "ahead": future}  # over any such keys the file may hold
    return Seen({**holder, **beat}, (info.st_dev, info.st_ino, info.st_mtime_ns, raw))


def ahead(holder: dict[str, Any], now: float) -> float | None:
    """How far the heartbeat of `holder` is ahead of this host's clock, when it is from the future; else None."""
    seconds = holder.get("ahead")
    if seconds is None:
        try:
            seconds = float(holder.get("heartbeat", 0)) - now
        except (TypeError, ValueError):
            return None
    return seconds if seconds > CLOCK_SLACK_S else None


def who(holder: dict[str, Any]) -> tuple[Any, Any]:
    """The holder's pid and host, as the lines that name it give them."""
    return holder.get("pid"), holder.get("host")
