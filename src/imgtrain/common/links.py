"""Symbolic links another user planted where a run writes: refused in one line, before anything is written.

A run (or sweep) directory may sit in a folder others can write to (a shared project folder). A link another user
put at a name the template or Hydra creates there (`.hydra`, `train.log`, `checkpoints/`, `tb/`, `profile/`, the run
directory itself) would send this user's writes wherever it points: Hydra's config into another run's files, a
checkpoint over any file this user may write. Files written by `atomic_write` replace a link at their name and never
follow it; directories and files opened by others' code (Hydra's, TensorBoard's) follow it, hence this check.

Links this user made (`outputs/`, `checkpoints/` or the run directory on a bigger disk) keep working: only a link
owned by another user is refused, and only at the run directory and below it, never the folders above it.
"""

from __future__ import annotations

import os
import pwd
import stat
from pathlib import Path, PurePath

from imgtrain.common.errors import ConfigError


def _owner(uid: int) -> str:
    try:
        return f"{pwd.getpwuid(uid).pw_name} (uid {uid})"
    except KeyError:  # a uid with no name here (a container, another host's user on a shared file system)
        return f"uid {uid}"


def _steps(directory: Path, names: tuple[str | PurePath, ...]) -> list[Path]:
    """`directory`, then every path on the way to each name inside it, each once, outermost first."""
    paths = [directory]
    for name in names:
        path = directory
        for part in PurePath(name).parts:
            path = path / part
            if path not in paths:
                paths.append(path)
    return paths


MAX_LINKS = 40  # links followed in a row before giving up: the kernel's own limit (ELOOP)


def own_target(path: Path, key: str = "hydra.run.dir") -> Path:
    """Where a write to `path` lands: `path` itself, or what this user's own links there lead to (followed, so a
    link of one's own keeps working). ConfigError (one line, naming the link and its owner) for a link another user
    made, at `path` or behind a link of this user's. `key`: the setting the line suggests changing."""
    current = path
    for _ in range(MAX_LINKS):
        try:
            info = os.lstat(current)  # the link itself, reached through any link of this user's own above it
        except OSError:  # not there (yet), or not reachable: whatever writes it next says why if it matters
            return current
        if not stat.S_ISLNK(info.st_mode):
            return current
        if info.st_uid != os.geteuid():
            behind = f" (behind {path}, a link of yours)" if current != path else ""
            raise ConfigError(
                f"{current}{behind} is a symbolic link owned by {_owner(info.st_uid)}, not by {_owner(os.geteuid())} "
                "who runs this: the run will not write through a link another user may have planted at a name it "
                f"writes (it could point at any file of yours). Remove it if it is not yours to use, or pass another "
                f"{key}"
            )
        current = current.parent / os.readlink(current)  # a relative link is relative to its own folder
    raise ConfigError(f"refusing to write {path}: more than {MAX_LINKS} symbolic links in a row")


def refuse_foreign_links(directory: Path, *names: str | PurePath, key: str = "hydra.run.dir") -> None:
    """ConfigError (one line, naming the link and its owner) if `directory`, or any path on the way to one of
    `names` inside it, is a symbolic link owned by a user other than the one running this process, or leads
    through links of this user's own to one (`own_target`).

    Names that do not exist yet pass (they are created later, by this user). `key` is the setting the line suggests
    changing (`hydra.sweep.dir` for a sweep directory)."""
    for path in _steps(directory, names):
        own_target(path, key)
