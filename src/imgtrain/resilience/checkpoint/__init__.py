"""Checkpoints: files that survive kills (`files`), what they hold (`state`), the background writer (`writer`)
and the run's checkpointer that decides when to save and resumes (`checkpointer`)."""

from imgtrain.resilience.checkpoint.checkpointer import Checkpointer
from imgtrain.resilience.checkpoint.files import (
    DIRNAME,
    FORMAT,
    FORMAT_VERSION,
    CheckpointError,
    CheckpointStore,
    damage,
    load,
    locate,
    write_verified,
)
from imgtrain.resilience.checkpoint.state import HostSnapshot, Progress, capture_rng, progress_dict, restore_rng
from imgtrain.resilience.checkpoint.writer import AsyncWriter

__all__ = [
    "DIRNAME",
    "FORMAT",
    "FORMAT_VERSION",
    "AsyncWriter",
    "CheckpointError",
    "CheckpointStore",
    "Checkpointer",
    "HostSnapshot",
    "Progress",
    "capture_rng",
    "damage",
    "load",
    "locate",
    "progress_dict",
    "restore_rng",
    "write_verified",
]
