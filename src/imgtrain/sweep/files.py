"""The sweep report's own file reads and writes. A job's files are read so that damage becomes a reason, never an
exception: a report over fifty jobs must not be lost to one truncated or edited file. The report's files are
written whole (`atomic_write`) and never through a symbolic link another user planted at their names; the report
checks its names with resilience/links.py first, and `own_target` follows this user's own links (which a check
alone does not) and checks the links behind them.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import Any

import yaml

from imgtrain.resilience.atomic import BadJSON, atomic_write
from imgtrain.resilience.atomic import read_json as parse_json
from imgtrain.resilience.errors import RunError

MAX_LINKS = 40  # links followed in a row before giving up: the kernel's own limit (ELOOP)


class Damaged(Exception):
    """A job's file that cannot be used: its message is the reason shown in the job's row."""


def read_text(path: Path, name: str | None = None) -> str:
    """The text of the regular file `path`; Damaged when it cannot be read, naming it `name` (default: its file
    name). Opened without blocking, so that a FIFO at a job file's name cannot hold the report forever."""
    name = name or path.name
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0))
        with open(fd, "rb") as file:
            if not stat.S_ISREG(os.fstat(file.fileno()).st_mode):
                raise Damaged(f"{name} is not a regular file")
            return file.read().decode()
    except (OSError, UnicodeDecodeError) as error:
        raise Damaged(f"{name} cannot be read ({_first_line(error)})") from error


def read_json(path: Path) -> Any:
    """The JSON value in `path`; Damaged (one line) when it is not JSON, nested too deeply to parse included
    (resilience.atomic.read_json says which)."""
    text = read_text(path)
    try:
        return parse_json(text, path.name)
    except BadJSON as error:
        raise Damaged(str(error)) from error


def read_yaml(path: Path, name: str | None = None) -> Any:
    """The YAML value in `path` (safe_load: plain data only); Damaged (one line, naming it `name`) when it is not
    YAML."""
    name = name or path.name
    text = read_text(path, name)
    try:
        return yaml.safe_load(text)
    except yaml.MarkedYAMLError as error:  # where and what, without PyYAML's multi-line excerpt
        mark = error.problem_mark
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        raise Damaged(f"{name} cannot be read (not YAML: {error.problem or error.context}{where})") from error
    except yaml.YAMLError as error:
        raise Damaged(f"{name} cannot be read (not YAML: {_first_line(error)})") from error
    except RecursionError as error:
        raise Damaged(f"{name} cannot be read (nested too deeply to parse)") from error


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


def own_target(path: Path) -> Path:
    """Where a write to `path` lands: `path` itself, or, when it is a symbolic link this user made, what the link
    points to (so that a link of one's own keeps working). RunError (one line) for a link another user made: in
    a shared sweep directory it could aim the report at any file this user may write."""
    current = path
    for _ in range(MAX_LINKS):
        try:
            info = os.lstat(current)
        except FileNotFoundError:
            return current
        if not stat.S_ISLNK(info.st_mode):
            return current
        if info.st_uid != os.geteuid():  # behind a link of this user's own: refuse_foreign_links checks the name
            raise RunError(
                f"{current} is a symbolic link owned by uid {info.st_uid}, not by this user, behind {path}: the sweep "
                "report does not write through a link another user may have planted (it could point at any file "
                "of yours). Remove it if it is not yours to use"
            )
        current = current.parent / os.readlink(current)  # a relative link is relative to its own folder
    raise RunError(f"refusing to write {path}: more than {MAX_LINKS} symbolic links in a row")


def write_file(path: Path, data: bytes) -> None:
    """Write `data` to `path` whole: readers see the old file or the new one (atomic_write), and a link another
    user planted at the name is refused (`own_target`), never written through."""
    atomic_write(own_target(path), lambda file: file.write(data))
