"""Checkpoints that survive being killed mid-write, and everything an exact resume needs.

<run dir>/checkpoints/ holds `last.pt`, the verified one before it (`last.prev.pt`) and `best.pt` (by
validation accuracy). A file is written to a temporary name, fsynced, verified (every zip entry's CRC) and
only then renamed over the old one, so a crash or a kill leaves the previous good file in place.
"""

from __future__ import annotations

import logging
import os
import random
import shutil
import zipfile
import zlib
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import numpy as np
import torch
from omegaconf import OmegaConf
from torch import nn

from imgtrain import dist
from imgtrain.config import Config, Mode
from imgtrain.errors import ConfigError, RunError
from imgtrain.faults import Faults
from imgtrain.host import atomic_write
from imgtrain.optim import Step

log = logging.getLogger(__name__)

FORMAT = "imgtrain-checkpoint"
FORMAT_VERSION = 1
DIRNAME = "checkpoints"


class CheckpointError(Exception):
    """A checkpoint that is damaged, truncated or not ours."""


@dataclass
class Progress:
    """Where training is: saved in every checkpoint, restored on resume."""

    step: int = 0  # optimizer steps taken (the same on every rank); TensorBoard's x axis
    epoch: int = 0  # the current epoch, counted from 0
    samples_in_epoch: int = 0  # samples of `epoch`'s order already trained on, over all ranks the sampler shards to
    best_val_acc: float | None = None
    val: dict[str, float] = field(default_factory=dict)
    skipped_samples: int = 0  # unreadable image reads, summed over ranks
    nonfinite_steps: int = 0  # steps skipped because the loss was NaN or inf (trainer.nonfinite=skip)
    replicas: int = field(default=1, metadata={"saved": False})  # ranks the order is sharded over (not saved)

    def begin_epoch(self, epoch: int) -> None:
        if epoch != self.epoch:
            self.epoch, self.samples_in_epoch = epoch, 0

    def advance(self, batch_images: int) -> None:
        """One optimizer step of `batch_images` images on this rank."""
        self.step += 1
        self.samples_in_epoch += batch_images * self.replicas

    def end_epoch(self) -> None:
        self.epoch, self.samples_in_epoch = self.epoch + 1, 0


# ----------------------------------------------------------------------------- files
def damage(path: Path) -> str | None:
    """Why `path` cannot be trusted, or None when its zip structure and every entry's CRC check out.

    torch.load alone notices truncation but not flipped bytes inside a tensor; the zip CRCs do.
    """
    try:
        if not zipfile.is_zipfile(path):
            return "not a complete torch.save archive (truncated or overwritten)"
        with zipfile.ZipFile(path) as archive:
            bad = archive.testzip()
    except (OSError, zipfile.BadZipFile, zlib.error, EOFError) as error:
        return str(error) or type(error).__name__
    return f"CRC mismatch in {bad}" if bad else None


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
    reason = damage(path)
    if reason:
        raise CheckpointError(reason)
    try:
        payload = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as error:  # noqa: BLE001 - any unpickling failure means the same thing here
        raise CheckpointError(str(error).strip().splitlines()[0]) from error
    if not isinstance(payload, dict) or payload.get("format") != FORMAT:
        raise CheckpointError("not an imgtrain checkpoint")
    if payload.get("version", 0) > FORMAT_VERSION:
        raise CheckpointError(f"written by a newer imgtrain (format {payload['version']} > {FORMAT_VERSION})")
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
        if enabled and directory.is_dir():
            for stale in directory.glob(".*.tmp"):  # left by a process killed mid-write
                stale.unlink(missing_ok=True)

    def save(self, payload: dict[str, Any]) -> Path:
        """Write last.pt; the previous last.pt, if it verifies, becomes last.prev.pt. Never replaces good with bad."""
        if not self.enabled:
            return self.last

        def keep_previous() -> None:
            if self.last.exists() and self._trust_last():
                os.replace(self.last, self.prev)  # best.pt may be a hard link to it: that link stays intact

        write_verified(payload, self.last, before_replace=keep_previous)
        self._last_trusted = True
        return self.last

    def mark_best(self) -> None:
        """best.pt = the last.pt just written: a hard link (no copy) where the filesystem allows it."""
        if not self.enabled:
            return
        tmp = self.directory / f".best.pt.{os.getpid()}.tmp"
        try:
            os.link(self.last, tmp)
        except OSError:
            shutil.copyfile(self.last, tmp)
        os.replace(tmp, self.best)

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
                f"no usable checkpoint in {self.directory}: {'; '.join(problems)}. Pass trainer.resume=none to "
                "start over, or trainer.resume=/path/to/checkpoint.pt"
            )
        return None


def locate(resume: str, store: CheckpointStore) -> tuple[Path, dict[str, Any]] | None:
    """What `trainer.resume` points at: auto (this run directory's checkpoints), none, or a file."""
    if resume == "none":
        return None
    if resume == "auto":
        return store.find()
    path = Path(resume).expanduser()
    try:
        return path, load(path)
    except CheckpointError as error:
        raise ConfigError(f"trainer.resume={resume} cannot be used: {error}") from None


# ----------------------------------------------------------------------------- random number generators
def capture_rng() -> dict[str, Any]:
    """Python, NumPy, torch CPU and CUDA generator states, in types torch.load(weights_only=True) accepts."""
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    state = {
        "python": random.getstate(),
        "numpy": {"kind": kind, "keys": torch.from_numpy(keys.astype(np.int64)), "pos": int(pos)},
        "numpy_gauss": (int(has_gauss), float(cached)),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng(state: dict[str, Any]) -> None:
    """Put every generator back where `capture_rng` found it."""
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    numpy = state["numpy"]
    has_gauss, cached = state["numpy_gauss"]
    keys = numpy["keys"].numpy().astype(np.uint32)
    np.random.set_state((numpy["kind"], keys, numpy["pos"], has_gauss, cached))
    torch.set_rng_state(state["torch"].cpu())
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([s.cpu() for s in state["cuda"]])


def progress_from(payload: dict[str, Any]) -> Progress:
    return Progress(**payload["progress"])


def progress_dict(progress: Progress) -> dict[str, Any]:
    return {f.name: getattr(progress, f.name) for f in fields(progress) if f.metadata.get("saved", True)}


# ----------------------------------------------------------------------------- the run's checkpointer
class Checkpointer:
    """A run's checkpoints: resume, periodic and epoch-end saves, best.pt, and acting on agreed faults.

    Only rank 0 writes; every rank calls the same methods at the same steps, so all agree on where the
    last checkpoint is.
    """

    def __init__(self, settings: Config, out_dir: Path, info: dist.DistInfo, faults: Faults) -> None:
        self.settings, self.info, self.faults = settings, info, faults
        self.writes = settings.mode == Mode.train and settings.trainer.save_checkpoints  # ceilings: speed only
        self.store = CheckpointStore(out_dir / DIRNAME, enabled=self.writes and info.is_main)
        self.every = settings.trainer.ckpt_every_n_steps
        self.model: nn.Module | None = None
        self.step_state: Step | None = None
        self.progress = faults.progress
        self.total_steps = 0

    def attach(self, model: nn.Module, step: Step, total_steps: int) -> None:
        """What the checkpoints hold: the underlying model (not its DDP or compiled wrapper) and the Step."""
        self.model, self.step_state, self.total_steps = model, step, total_steps

    def step(self, progress: Progress) -> None:
        """After every step: act on faults agreed at a window; write last.pt every trainer.ckpt_every_n_steps."""
        self.faults.act(self.save_and_wait, self.last_checkpoint())
        if self.every and progress.step % self.every == 0 and progress.step < self.total_steps:
            self.save()

    def end_epoch(self, improved: bool) -> None:
        """last.pt at the end of an epoch, and best.pt when validation accuracy improved."""
        self.save()
        if improved:
            self.store.mark_best()

    def save(self) -> str:
        """Write last.pt now (rank 0), never with weights a NaN loss has reached; a sentence saying where."""
        self.faults.before_save(self.last_checkpoint())
        if not self.writes:
            return "Checkpoints are off (trainer.save_checkpoints=false or mode is not train)."
        if self.store.enabled:
            self.store.save(
                {
                    "format": FORMAT,
                    "version": FORMAT_VERSION,
                    "model": self.model.state_dict(),
                    **self.step_state.state_dict(),
                    "progress": progress_dict(self.progress),
                    "rng": capture_rng(),
                    "global_batch": self.settings.data.batch_size * self.info.world_size,
                    "config": OmegaConf.to_yaml(self.settings),
                }
            )
        return f"The last checkpoint is {self.store.last} (step {self.progress.step})."

    def save_and_wait(self) -> str:
        """Save, and keep every rank until rank 0 has (so torchrun does not kill it mid-write)."""
        where = self.save()
        dist.barrier()
        return where

    def last_checkpoint(self) -> str:
        last = self.store.last
        return f"The last good checkpoint is {last}." if last.exists() else "No checkpoint had been written yet."

    def resume(self) -> Progress:
        """Load what `trainer.resume` points at (rank 0 chooses the file, every rank reads it); else start fresh."""
        if self.settings.mode != Mode.train:
            return self.progress
        found, problem = None, None
        if self.info.is_main:
            try:
                found = locate(self.settings.trainer.resume, self.store)
            except (ConfigError, RunError) as error:
                problem = error
        chosen = dist.broadcast_object(
            ("error", str(problem)) if problem else str(found[0]) if found else None, self.info
        )
        if isinstance(chosen, tuple):  # every rank stops with rank 0's message, none waits for the others
            raise problem if problem else RunError(chosen[1])
        if chosen is None:
            return self.progress
        payload = found[1] if self.info.is_main else load(Path(chosen))
        self._restore(payload, chosen)
        return self.progress

    def _restore(self, payload: dict[str, Any], chosen: str) -> None:
        try:
            self.model.load_state_dict(payload["model"])
            self.step_state.load_state_dict(payload)
        except (RuntimeError, ValueError, KeyError) as error:  # another model, optimizer or number of classes
            first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
            raise RunError(
                f"the checkpoint {chosen} does not fit this run's model or optimizer ({first}): resume with the "
                "settings it was trained with, or pass trainer.resume=none (or a new hydra.run.dir) to start over"
            ) from None
        restore_rng(payload["rng"])
        saved = progress_from(payload)
        for key, value in progress_dict(saved).items():  # the same object the loop and faults already hold
            setattr(self.progress, key, value)
        self.faults.bad.count = self.progress.skipped_samples
        global_batch = self.settings.data.batch_size * self.info.world_size
        if payload["global_batch"] != global_batch:
            log.warning(
                "the checkpoint was trained with a global batch of %d, this run uses %d: the epoch resumes at the "
                "same sample, and the step count and LR schedule follow the new setting",
                *(payload["global_batch"], global_batch),
            )
        log.info(
            "resuming from %s: step %d, epoch %d, %d samples into the epoch",
            *(chosen, self.progress.step, self.progress.epoch + 1, self.progress.samples_in_epoch),
        )
