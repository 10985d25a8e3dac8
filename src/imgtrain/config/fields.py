"""The building blocks of the config schemas: choices (Enums OmegaConf checks) and fields with range checks.

`fields` → a group's schema (`data`, `model`, `optim`, ..., `datasets`) → `schema` (Config) → `validate`: each
imports only the ones before it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import field
from enum import Enum
from typing import Any

AUTO = "auto"
TUNE = "tune"  # data.num_workers=tune: probe the loader at a few worker counts before training
SECONDS = "expected seconds > 0"  # what a duration's check says it accepts


class Choice(str, Enum):
    """A config choice: OmegaConf checks it and lists the options; it compares and prints as its name."""

    def __str__(self) -> str:
        return self.value

    def __format__(self, spec: str) -> str:
        return format(self.value, spec)


class AugmentOn(Choice):
    """Where a batch is cropped, resized and flipped (data.augment_on)."""

    auto = "auto"  # on a CUDA device when the batch's images share a size near the crop's, else in the workers
    workers = "workers"  # in the DataLoader workers, before the batch travels
    device = "device"  # on the training device (CPU training: the training process), after it travels


Check = Callable[[Any], str | None]  # None when the value is fine, else what is accepted


def is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def at_least(low: float, what: str = "an integer", note: str = "", null: str | None = None) -> Check:
    """`value >= low`; `null`, when given, says what null means (and allows it)."""

    def check(value: Any) -> str | None:
        if value is None and null is not None:
            return None
        if value is None or value < low:
            allowed = f"null{f' ({null})' if null else ''} or " if null is not None else ""
            return f"expected {allowed}{what} >= {low:g}{f' ({note})' if note else ''}"
        return None

    return check


def auto_or_bool(value: Any) -> str | None:
    return None if value == AUTO or isinstance(value, bool) else "accepted values are auto, true, false"


def checked(default: Any, check: Check) -> Any:
    """A field with its default and its range check (run by `validate`)."""
    if isinstance(default, list):
        return field(default_factory=lambda: list(default), metadata={"check": check})
    return field(default=default, metadata={"check": check})
