"""Files written so that no reader sees half of one: a temporary file in the same directory, then a rename; and
JSON read back so that whatever a file holds is one plain line (`read_json`).

No torch here: `data.shapes` generates images in pool workers that should start quickly.
"""

from __future__ import annotations

import json
import os
import secrets
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any


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

    The directory may be writable by others (a shared project folder) and the pid is in the lock file, so the
    temporary name is random and created with O_EXCL | O_NOFOLLOW: a file or symlink planted at a name
    is never written through. It stays `.{name}.*.tmp`, the name CheckpointStore clears after a crash.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
    for attempt in range(10):  # a name taken (64 random bits: only by a plant that guessed it): another one
        tmp = path.with_name(f".{path.name}.{secrets.token_hex(8)}.tmp")
        try:
            fd = os.open(tmp, flags, 0o666)  # the umask applies, as with open(): as readable as before
            break
        except FileExistsError:
            if attempt == 9:
                raise
    replaced = False
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            if durable:
                f.flush()
                os.fsync(f.fileno())
        if check is not None:
            check(tmp)
        if before_replace is not None:
            before_replace()
        os.replace(tmp, path)
        replaced = True  # from here the name is free again: whatever appears there is not ours to remove
        if durable:
            fsync_dir(path.parent)
    except OSError as error:
        if error.filename is None:  # a write to the open file names none: say which (a full disk, above all)
            error.filename = str(path)
        raise
    finally:
        if not replaced:
            tmp.unlink(missing_ok=True)


class BadJSON(ValueError):
    """JSON that cannot be read: `why` says what is wrong ("not valid JSON: ...", "nested too deeply to parse"),
    the message "<what> cannot be read (<why>)". A ValueError, as json.JSONDecodeError is."""

    def __init__(self, what: str, why: str) -> None:
        super().__init__(f"{what} cannot be read ({why})")
        self.what, self.why = what, why


def read_json(source: Path | str | bytes, what: str | None = None) -> Any:
    """The JSON value of a file (a Path) or of its text; BadJSON naming `what` (by default the path) otherwise.

    Python's parser recurses once per level of nesting: 100,000 `[` are a RecursionError, not a JSONDecodeError,
    and that is caught here too. A file that cannot be opened raises its OSError, for the caller to judge."""
    if isinstance(source, Path):
        what = what or str(source)
        source = source.read_bytes()
    what = what or "the JSON text"
    try:
        return json.loads(source)
    except RecursionError:
        raise BadJSON(what, "nested too deeply to parse") from None
    except ValueError as error:  # JSONDecodeError, UnicodeDecodeError, an integer of more than 4,300 digits
        text = str(error).strip()  # common.errors' first_line, without importing Hydra here (see above)
        raise BadJSON(what, f"not valid JSON: {text.splitlines()[0] if text else type(error).__name__}") from None


def write_json(path: Path, payload: dict[str, Any]) -> None:
    """Write JSON atomically (temporary file, then rename)."""
    text = json.dumps(payload, indent=2, default=str) + "\n"
    atomic_write(path, lambda f: f.write(text.encode()))
