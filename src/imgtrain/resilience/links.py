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

from imgtrain.resilience.errors import ConfigError


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


def refuse_foreign_links(directory: Path, *names: str | PurePath, key: str = "hydra.run.dir") -> None:
    """ConfigError (one line, naming the link and its owner) if `directory`, or any path on the way to one of
    `names` inside it, is a symbolic link owned by a user other than the one running this process.

    Names that do not exist yet pass (they are created later, by this user). A link of this user's own is
    followed, and what is behind it checked in turn. `key` is the setting the line suggests changing
    (`hydra.sweep.dir` for a sweep directory)."""
    me = os.geteuid()
    for path in _steps(directory, names):
        try:
            info = os.lstat(path)  # the link itself, reached through any link of this user's own above it
        except OSError:  # not there (yet), or not reachable: whatever writes it next says why if it matters
            continue
        if stat.S_ISLNK(info.st_mode) and info.st_uid != me:
            raise ConfigError(
                f"{path} is a symbolic link owned by {_owner(info.st_uid)}, not by {_owner(me)} who runs this: "
                f"the run will not write through a link another user may have planted at a name it writes (it could "
                f"point at any file of yours). Remove it if it is not yours to use, or pass another {key}"
            )
