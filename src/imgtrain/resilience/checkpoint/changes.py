"""What a resumed run sets differently from the run that wrote its checkpoint: the settings that decide how long
training lasts and how it updates (epochs, steps, the global batch, the `optim` and `schedule` groups), for the one
line that says so when it resumes."""

from __future__ import annotations

from typing import Any

import yaml
from omegaconf import OmegaConf

from imgtrain.common.brief import brief
from imgtrain.common.plain_yaml import load_plain

WATCHED = ("train.epochs", "train.max_steps", "optim", "schedule")
MAX_CONFIG_CHARS = 1 << 20  # a run's settings as OmegaConf writes them take a few KB; PyYAML parses about 1 MB/s


def changed_settings(saved_config: Any, settings: Any, saved_batch: int, global_batch: int) -> list[str]:
    """`key old -> new` for each watched setting that differs, the global batch first. `saved_config`: the
    checkpoint's `config` entry (OmegaConf's YAML of the run's settings); unreadable, it is said so."""
    changes = [f"global batch {saved_batch} -> {global_batch}"] if saved_batch != global_batch else []
    try:
        readable = isinstance(saved_config, str) and len(saved_config) <= MAX_CONFIG_CHARS
        saved = load_plain(saved_config) if readable else None
    except (yaml.YAMLError, RecursionError, ValueError):  # ValueError: an int of more than 4,300 digits
        saved = None
    if not isinstance(saved, dict):
        return [*changes, "the checkpoint's settings could not be read"]
    ours = yaml.safe_load(OmegaConf.to_yaml(settings))  # the same rendering the checkpoint's went through
    before, after = _watched(saved), _watched(ours)
    for key in sorted(before.keys() | after.keys(), key=_order):
        old, new = before.get(key, "(unset)"), after.get(key, "(unset)")
        if old != new:
            changes.append(f"{key} {_short(old)} -> {_short(new)}")
    return changes


def _watched(tree: dict[str, Any]) -> dict[str, Any]:
    flat = _flatten(tree)
    return {key: value for key, value in flat.items() if any(key == w or key.startswith(f"{w}.") for w in WATCHED)}


def _flatten(tree: Any, prefix: str = "") -> dict[str, Any]:
    if not isinstance(tree, dict):
        return {prefix.rstrip("."): tree}
    flat: dict[str, Any] = {}
    for key, value in tree.items():
        flat.update(_flatten(value, f"{prefix}{key}."))
    return flat


def _order(key: str) -> tuple[int, str]:
    return next(i for i, w in enumerate(WATCHED) if key == w or key.startswith(f"{w}.")), key


def _short(value: Any) -> str:
    """A builder's `_target_` by its own name (imgtrain.train.schedules.warmup_step: warmup_step)."""
    if isinstance(value, str) and "." in value and " " not in value and not value[0].isdigit():
        return value.rsplit(".", 1)[-1]
    return brief(value, 60) if not isinstance(value, (str, int, float, bool)) else str(value)[:60]
