"""The machine the process runs on: the CPUs it may use, and files written so no reader sees half of one.

No torch here: `data.shapes` generates images in pool workers that should start quickly.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any


def available_cpus() -> int:
    """CPUs this process may run on (honours taskset, cgroups cpusets and SLURM bindings)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # macOS and Windows have no sched_getaffinity
        return os.cpu_count() or 1


def fsync_dir(directory: Path) -> None:
    """Make a rename inside `directory` durable."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write(
    path: Path,
    write: Callable[[IO[bytes]], None],
    *,
    durable: bool = False,
    check: Callable[[Path], None] | None = None,
    before_replace: Callable[[], None] | None = None,
) -> None:
    """Write `path` so that readers see the old file or the complete new one, never a partial one.

    `write` fills a temporary file in the same directory (so the final rename is atomic). `durable` fsyncs
    the file and the directory; `check` may raise to keep the old file; `before_replace` runs just before
    the rename (checkpoints keep the previous file there).
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "wb") as f:
            write(f)
            if durable:
                f.flush()
                os.fsync(f.fileno())
        if check is not None:
            check(tmp)
        if before_replace is not None:
            before_replace()
        os.replace(tmp, path)
        if durable:
            fsync_dir(path.parent)
    finally:
        tmp.unlink(missing_ok=True)


def write_json(path: Path, payload: dict[str, Any]) -> None:
    """Write JSON atomically (temporary file, then rename)."""
    text = json.dumps(payload, indent=2, default=str) + "\n"
    atomic_write(path, lambda f: f.write(text.encode()))
