"""The sweep report's own file reads and writes. A job's files are read so that damage becomes a reason, never an
exception: a report over fifty jobs must not be lost to one truncated or edited file. The report's files are
written whole (`atomic_write`) and never through a symbolic link another user planted at their names; the report
checks its names with common/links.py first (this user's own links followed, the links behind them checked).
"""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import Any

import yaml

from imgtrain.common.atomic import BadJSON, atomic_write
from imgtrain.common.atomic import read_json as parse_json
from imgtrain.common.errors import first_line
from imgtrain.common.links import own_target
from imgtrain.common.plain_yaml import load_plain


class Damaged(Exception):
    """A job's file that cannot be used: its message is the reason shown in the job's row."""


# The most bytes a job file may take: a run's metrics.json holds a figure per logging window (90 ImageNet epochs at
# the default window: about 100 KB); a larger file is not one a run wrote, and is not read
MAX_JOB_FILE_BYTES = 16 << 20


def read_text(path: Path, name: str | None = None) -> str:
    """The text of the regular file `path`; Damaged when it cannot be read, naming it `name` (default: its file
    name). Opened without blocking, so that a FIFO at a job file's name cannot hold the report forever; at most
    MAX_JOB_FILE_BYTES."""
    name = name or path.name
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0))
        with open(fd, "rb") as file:
            if not stat.S_ISREG(os.fstat(file.fileno()).st_mode):
                raise Damaged(f"{name} is not a regular file")
            data = file.read(MAX_JOB_FILE_BYTES + 1)
            if len(data) > MAX_JOB_FILE_BYTES:
                raise Damaged(f"{name} is larger than {MAX_JOB_FILE_BYTES >> 20} MiB, more than a run writes: not read")
            return data.decode()
    except (OSError, UnicodeDecodeError) as error:
        raise Damaged(f"{name} cannot be read ({first_line(error)})") from error


def read_json(path: Path) -> Any:
    """The JSON value in `path`; Damaged (one line) when it is not JSON, nested too deeply to parse included
    (common.atomic.read_json says which)."""
    text = read_text(path)
    try:
        return parse_json(text, path.name)
    except BadJSON as error:
        raise Damaged(str(error)) from error


def read_yaml(path: Path, name: str | None = None) -> Any:
    """The YAML value in `path` (plain data only, no aliases: common/plain_yaml.py); Damaged (one line, naming it
    `name`) when it is not YAML."""
    name = name or path.name
    text = read_text(path, name)
    try:
        return load_plain(text)
    except yaml.MarkedYAMLError as error:  # where and what, without PyYAML's multi-line excerpt
        mark = error.problem_mark
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        raise Damaged(f"{name} cannot be read (not YAML: {error.problem or error.context}{where})") from error
    except yaml.YAMLError as error:
        raise Damaged(f"{name} cannot be read (not YAML: {first_line(error)})") from error
    except RecursionError as error:
        raise Damaged(f"{name} cannot be read (nested too deeply to parse)") from error
    except ValueError as error:  # an integer of more than 4,300 digits
        raise Damaged(f"{name} cannot be read ({first_line(error)})") from error


def write_file(path: Path, data: bytes) -> None:
    """Write `data` to `path` whole: readers see the old file or the new one (atomic_write), and a link another
    user planted at the name, or behind a link of this user's there, is refused (`links.own_target`), never written
    through."""
    atomic_write(own_target(path, key="hydra.sweep.dir"), lambda file: file.write(data))
