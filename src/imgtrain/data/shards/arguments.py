"""The argparse types of `imgtrain-shards`' options: a bad value is argparse's one line naming the option and what
it accepts."""

from __future__ import annotations

import argparse
from collections.abc import Callable


def pixel_limit(text: str) -> int | None:
    """--max-image-pixels: pixels >= 1, or none."""
    if text.strip().lower() in ("none", "null"):
        return None
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: expected pixels >= 1, or none (no limit)")
    return value


def whole_number(low: int, high: int | None, what: str) -> Callable[[str], int]:
    """An argparse type: a whole number from `low` to `high` (None: no limit), else one line saying so."""
    accepted = f"a whole number >= {low}" if high is None else f"a whole number from {low} to {high}"

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = low - 1
        if value < low or (high is not None and value > high):
            raise argparse.ArgumentTypeError(f"{text!r}: expected {accepted} ({what})")
        return value

    return parse
