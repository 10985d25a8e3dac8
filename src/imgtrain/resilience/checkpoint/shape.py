"""What a checkpoint must hold, checked before any of it is used. `files.load` has checked that the file is a zip
of plain data (weights_only) in imgtrain's format; a file of that format whose fields were edited, or that some
other program wrote, ends here in one line naming the field, not in a traceback from deep inside load_state_dict.
`check_shape` checks each field's kind; `check_reach` its place against this run (the LR schedule is positioned,
and the loop counts, from the stored progress: a number no run of this data reaches is refused before it costs
any time).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import fields
from typing import Any

import torch

from imgtrain.common.brief import brief, brief_int
from imgtrain.resilience.checkpoint.state import Progress
from imgtrain.resilience.faults import FaultCounts


class FieldError(ValueError):
    """A checkpoint field that is missing or of the wrong kind: its dotted name and what was wrong."""

    def __init__(self, name: str, problem: str) -> None:
        super().__init__(f"{name} {problem}")


def _kind(value: Any) -> str:
    kind = type(value).__name__
    return f"{brief(value, 43)} ({'an' if kind[0] in 'aeiou' else 'a'} {kind})"


def _whole(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _number_or_none(value: Any) -> bool:
    return value is None or (isinstance(value, (int, float)) and not isinstance(value, bool))


# GradScaler.state_dict(): what fp16 training multiplies and counts with from its first step on
SCALER = {
    "scale": float,
    "growth_factor": float,
    "backoff_factor": float,
    "growth_interval": int,
    "_growth_tracker": int,
}


def _scaler(value: Any) -> bool:
    if not isinstance(value, dict) or (value and set(value) != set(SCALER)):
        return False
    return all(_whole(value[key]) if kind is int else _finite(value[key]) for key, kind in SCALER.items() if value)


def _finite(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _gauss(value: Any) -> bool:
    """NumPy's cached Gaussian: (whether there is one, its value), as capture_rng saves it."""
    if not (isinstance(value, (tuple, list)) and len(value) == 2 and isinstance(value[0], int) and value[0] in (0, 1)):
        return False
    return _finite(value[1])


def _numbers(value: Any) -> bool:
    return isinstance(value, dict) and all(isinstance(k, str) and _number_or_none(v) for k, v in value.items())


def _texts(value: Any) -> bool:
    return isinstance(value, dict) and all(isinstance(k, str) and isinstance(v, str) for k, v in value.items())


# What each field of a checkpoint's `progress` entry may hold, by its annotation in Progress and FaultCounts (one
# source of truth: a field added there with a new kind of value fails tests/test_trust.py until it is listed here).
ANNOTATIONS: dict[str, tuple[Callable[[Any], bool], str]] = {
    "int": (_whole, "a whole number >= 0"),
    "float | None": (_number_or_none, "a number or null"),
    "dict[str, float]": (_numbers, "a mapping of names to numbers"),
    "dict[str, str]": (_texts, "a mapping of paths to reasons"),
}


def check_shape(payload: dict[str, Any]) -> None:
    """Raise FieldError for the first field that is missing or of the wrong kind."""
    _tensors(payload, "model")
    _optimizer(payload)
    _field(payload, "scaler", _scaler, "GradScaler's state (a mapping of its 5 numbers; empty when it was off)")
    if "ema" in payload:
        _tensors(payload, "ema")
        _field(payload, "ema_updates", lambda v: isinstance(v, torch.Tensor) and v.numel() == 1, "a one-element tensor")
    _progress(payload)
    _rng(payload)
    _field(payload, "global_batch", lambda v: _whole(v) and v > 0, "a whole number > 0")
    if payload.get("data_order") is not None:
        _field(payload, "data_order", lambda v: isinstance(v, dict), "a mapping or null")


def _field(tree: dict[str, Any], name: str, good: Callable[[Any], bool], expected: str, prefix: str = "") -> Any:
    if name not in tree:
        raise FieldError(prefix + name, "is missing")
    value = tree[name]
    if not good(value):
        raise FieldError(prefix + name, f"is {_kind(value)}, expected {expected}")
    return value


def _tensors(payload: dict[str, Any], name: str) -> None:
    def good(value: Any) -> bool:
        return isinstance(value, dict) and all(isinstance(k, str) for k in value)

    state = _field(payload, name, good, "a state_dict (a mapping of names to tensors)")
    for key, value in state.items():
        if not isinstance(value, torch.Tensor) and not (key.endswith("_extra_state")):
            raise FieldError(f"{name}.{key}", f"is {_kind(value)}, expected a tensor")


def _optimizer(payload: dict[str, Any]) -> None:
    optimizer = _field(payload, "optimizer", lambda v: isinstance(v, dict), "an optimizer's state_dict")
    _field(optimizer, "state", lambda v: isinstance(v, dict), "a mapping of parameter ids to buffers", "optimizer.")
    groups = _field(optimizer, "param_groups", lambda v: isinstance(v, list), "a list of mappings", "optimizer.")
    for index, group in enumerate(groups):
        where = f"optimizer.param_groups[{index}]"
        if not isinstance(group, dict):
            raise FieldError(where, f"is {_kind(group)}, expected a mapping")
        ids = lambda v: isinstance(v, list) and all(_whole(i) for i in v)  # noqa: E731
        _field(group, "params", ids, "a list of parameter ids", f"{where}.")
    if "optimizer_class" in payload:
        _field(payload, "optimizer_class", lambda v: isinstance(v, str), "a class name")


def _progress(payload: dict[str, Any]) -> None:
    progress = _field(payload, "progress", lambda v: isinstance(v, dict), "a mapping")
    known = {f.name: f.type for f in (*fields(Progress), *fields(FaultCounts)) if f.metadata.get("saved", True)}
    for name in progress:
        if name not in known:
            raise FieldError(f"progress.{name}", f"is not a field imgtrain saves (those are {', '.join(known)})")
    for name in ("step", "epoch", "samples_in_epoch"):
        _field(progress, name, _whole, "a whole number >= 0", "progress.")
    for name, value in progress.items():
        good, expected = ANNOTATIONS[known[name]]
        if not good(value):
            raise FieldError(f"progress.{name}", f"is {_kind(value)}, expected {expected}")


def _rng(payload: dict[str, Any]) -> None:
    rng = _field(payload, "rng", lambda v: isinstance(v, dict), "a mapping of generator states")
    triple = lambda v: isinstance(v, (tuple, list)) and len(v) == 3  # noqa: E731
    python = _field(rng, "python", triple, "(version, state, gauss)", "rng.")
    if not (isinstance(python[1], (tuple, list)) and all(_whole(i) for i in python[1])):
        raise FieldError("rng.python", "holds a state that is not a sequence of whole numbers")
    numpy = _field(rng, "numpy", lambda v: isinstance(v, dict), "a mapping (kind, keys, pos)", "rng.")
    _field(numpy, "kind", lambda v: isinstance(v, str) and v == "MT19937", "'MT19937'", "rng.numpy.")
    _field(numpy, "keys", lambda v: isinstance(v, torch.Tensor), "a tensor", "rng.numpy.")
    _field(numpy, "pos", _whole, "a whole number >= 0", "rng.numpy.")
    _field(rng, "numpy_gauss", _gauss, "(0 or 1, a finite number)", "rng.")
    _field(rng, "torch", lambda v: isinstance(v, torch.Tensor) and v.dtype == torch.uint8, "a uint8 tensor", "rng.")


def epoch_samples_bound(steps_per_epoch: int, global_batch: int, saved_global_batch: int) -> int:
    """More samples than one epoch of this run's data can hold, whatever the batch and the number of ranks the
    checkpoint was written with: this run's epoch holds fewer than `steps_per_epoch` + 1 of its batches (drop_last
    leaves less than one out), and each sampler pads its ranks' shares by fewer samples than one global batch."""
    return (steps_per_epoch + 2) * global_batch + saved_global_batch


def check_reach(payload: dict[str, Any], epochs: int, epoch_samples: int) -> None:
    """Raise FieldError for stored progress this run cannot reach (after `check_shape`): an epoch past its
    `epochs` (train.epochs), more samples into the epoch than `epoch_samples` (`epoch_samples_bound`), or more
    optimizer steps than the samples the checkpoint says were trained (each step trains at least one)."""
    progress = payload["progress"]
    epoch, samples, step = progress["epoch"], progress["samples_in_epoch"], progress["step"]
    if epoch > epochs:
        raise FieldError(
            "progress.epoch", f"is {brief_int(epoch)}, past this run's {epochs} epoch(s) (train.epochs={epochs})"
        )
    if samples > epoch_samples:
        raise FieldError(
            "progress.samples_in_epoch",
            f"is {brief_int(samples)}, more than one epoch of this run's data holds (at most {epoch_samples})",
        )
    trained = epoch * epoch_samples + samples
    if step > trained:
        raise FieldError(
            "progress.step",
            f"is {brief_int(step)}, more optimizer steps than the samples of {epoch} epoch(s) and {samples} more "
            f"(at most {trained})",
        )
