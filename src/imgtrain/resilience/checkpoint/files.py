"""Checkpoint files that survive being killed mid-write: last.pt, last.prev.pt and best.pt in one directory.

A file is written to a temporary name, fsynced, verified (every zip entry's CRC) and only then renamed over
the old one, so a crash, a kill or a full disk leaves the previous good file in place.
"""

from __future__ import annotations

import logging
import os
import pickle
import secrets
import shutil
import stat
import zipfile
import zlib
from pathlib import Path
from typing import Any

import torch

from imgtrain.common.atomic import atomic_write, fsync_dir
from imgtrain.common.brief import brief
from imgtrain.common.errors import ConfigError, RunError, first_line
from imgtrain.common.links import refuse_foreign_links
from imgtrain.common.safe_load import unsafe_torch_reason

log = logging.getLogger(__name__)

FORMAT = "imgtrain-checkpoint"
FORMAT_VERSION = 1
DIRNAME = "checkpoints"


class CheckpointError(Exception):
    """A checkpoint that is damaged, truncated or not ours."""


def damage(path: Path) -> str | None:
    """Why `path` cannot be trusted, or None when its zip structure and every entry's CRC check out.

    torch.load alone notices truncation but not flipped bytes inside a tensor; the zip CRCs do. torch.save stores
    every entry as it is, so an archive whose entries unpack to more than they take is not one: refused before any
    is unpacked (a few MB of zeros, compressed, would unpack to gigabytes), so reading costs at most the file's size.
    """
    try:
        if not zipfile.is_zipfile(path):
            return "not a complete torch.save archive (truncated or overwritten)"
        with zipfile.ZipFile(path) as archive:
            packed = [entry for entry in archive.infolist() if entry.compress_type != zipfile.ZIP_STORED]
            if packed:
                name = brief(packed[0].filename, 80)
                return f"its entry {name} is compressed, which torch.save never does: not unpacked"
            bad = archive.testzip()
    # zipfile's own kinds of damage besides BadZipFile: a name not in the encoding its flag says (ValueError:
    # UnicodeDecodeError), an encrypted entry (RuntimeError), a compression method it lacks (NotImplementedError)
    except (OSError, zipfile.BadZipFile, zlib.error, EOFError, ValueError, RuntimeError, NotImplementedError) as error:
        return first_line(error)
    return f"CRC mismatch in {brief(bad, 80)}" if bad else None  # a name as the file has it: one line, bounded


def _check(tmp: Path) -> None:
    reason = damage(tmp)
    if reason:
        raise CheckpointError(f"the checkpoint written to {tmp} does not verify ({reason})")


def write_verified(payload: dict[str, Any], path: Path, before_replace: Any = None) -> None:
    """torch.save to a temporary file, fsync, check it reads back intact, then rename it over `path`."""
    atomic_write(path, lambda f: torch.save(payload, f), durable=True, check=_check, before_replace=before_replace)


def load(path: Path) -> dict[str, Any]:
    """Read and check a checkpoint (weights_only: no code runs from the file); CheckpointError if unusable.

    Everything lands in host memory: `load_state_dict` then places each tensor where its module or optimizer
    lives (AdamW's `step` stays on the CPU unless the optimizer is fused), and the RNG states must be CPU
    tensors anyway. Mapping to the GPU here broke resume on CUDA.
    """
    unsafe = unsafe_torch_reason()
    if unsafe:
        raise CheckpointError(f"torch {torch.__version__} cannot load it safely: {unsafe}")
    reason = damage(path)
    if reason:
        raise CheckpointError(reason)
    try:
        payload = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as error:  # weights_only refused a global: code that loading would have run
        lines = [line.strip() for line in str(error).splitlines()[1:] if line.strip()]
        # what the unpickler refused ("Unsupported global: GLOBAL posix.system ...", "Unsupported operand 139")
        detail = next((line for line in lines if "Unsupported" in line), lines[0] if lines else "")
        raise CheckpointError(
            f"it holds Python objects other than tensors and plain data, which are never loaded ({detail})"
        ) from error
    except Exception as error:  # noqa: BLE001 - any other unpickling failure means the same thing here
        raise CheckpointError(str(error).strip().splitlines()[0]) from error
    if not isinstance(payload, dict) or payload.get("format") != FORMAT:
        raise CheckpointError("not an imgtrain checkpoint")
    version = payload.get("version")
    if not isinstance(version, int) or isinstance(version, bool) or version < 1:
        raise CheckpointError(
            f"its version is {brief(version)}, not a format number (imgtrain writes {FORMAT_VERSION})"
        )
    if version > FORMAT_VERSION:
        raise CheckpointError(f"written by a newer imgtrain (format {version} > {FORMAT_VERSION})")
    return payload


class CheckpointStore:
    """last.pt, last.prev.pt and best.pt in one directory. Only the writer (rank 0) passes enabled=True."""

    def __init__(self, directory: Path, enabled: bool) -> None:
        self.directory = directory
        self.enabled = enabled
        self.last = directory / "last.pt"
        self.prev = directory / "last.prev.pt"
        self.best = directory / "best.pt"
        self._last_trusted: bool | None = None  # None: not checked yet
        if enabled:  # checkpoints/ (or the run directory) a link another user planted: never written through
            refuse_foreign_links(directory.parent, directory.name)
        if enabled and directory.is_dir():
            for stale in directory.glob(".*.tmp"):  # left by a process killed mid-write (the run-directory
                try:  # lock makes sure no other process is writing one now); a planted link, not its target
                    if stat.S_ISREG(stale.lstat().st_mode) or stale.is_symlink():
                        stale.unlink()
                except FileNotFoundError:
                    pass
                except OSError as error:  # not ours to remove: it costs only its space
                    log.warning("could not remove the leftover file %s (%s)", stale, error.strerror or error)

    def save(self, payload: dict[str, Any], best: bool = False) -> Path:
        """Write last.pt; the previous last.pt, if it verifies, becomes last.prev.pt. Never replaces good with bad.

        `best`: best.pt becomes this file too.
        """
        if not self.enabled:
            return self.last

        def keep_previous() -> None:
            if self.last.exists() and self._trust_last():
                os.replace(self.last, self.prev)  # best.pt may be a hard link to it: that link stays intact

        write_verified(payload, self.last, before_replace=keep_previous)
        self._last_trusted = True
        if best:
            self.mark_best()
        return self.last

    def mark_best(self) -> None:
        """best.pt = the last.pt just written: a hard link (no copy) where the filesystem allows it.

        The link gets a random temporary name (as in `atomic_write`; os.link never follows or replaces what is
        there); without hard links, or should a plant hold that name, a copy is written by `atomic_write`."""
        if not self.enabled:
            return
        tmp = self.directory / f".best.pt.{secrets.token_hex(8)}.tmp"
        try:
            os.link(self.last, tmp)
        except OSError:
            with open(self.last, "rb") as source:
                atomic_write(self.best, lambda f: shutil.copyfileobj(source, f), durable=True)
            return
        try:
            os.replace(tmp, self.best)
        except OSError:
            tmp.unlink(missing_ok=True)
            raise
        fsync_dir(self.directory)  # the rename itself, durable as last.pt's

    def _trust_last(self) -> bool:
        if self._last_trusted is None:
            self._last_trusted = damage(self.last) is None
        return self._last_trusted

    def find(self) -> tuple[Path, dict[str, Any]] | None:
        """The newest usable checkpoint here (last.pt, else last.prev.pt with a warning); None if there is none."""
        problems = []
        for path in (self.last, self.prev):
            if not path.exists():
                continue
            try:
                payload = load(path)
            except CheckpointError as error:
                problems.append(f"{path.name} ({error})")
                log.warning("checkpoint %s is damaged (%s): trying the previous one", path, error)
                if path == self.last:
                    self._last_trusted = False  # the next save must not rotate it over the good last.prev.pt
                continue
            if problems:
                log.warning("resuming from %s instead of the damaged %s", path, ", ".join(problems))
            return path, payload
        if problems:
            raise RunError(
                f"no usable checkpoint in {self.directory}: {'; '.join(problems)}. Pass checkpoint.resume=none to "
                "start over, or checkpoint.resume=/path/to/checkpoint.pt"
            )
        return None


def locate(resume: str, store: CheckpointStore) -> tuple[Path, dict[str, Any]] | None:
    """What `checkpoint.resume` points at: auto (this run directory's checkpoints), none, or a file."""
    if resume == "none":
        return None
    if resume == "auto":
        return store.find()
    path = Path(resume).expanduser()
    try:
        return path, load(path)
    except CheckpointError as error:
        raise ConfigError(f"checkpoint.resume={resume} cannot be used: {error}") from None
