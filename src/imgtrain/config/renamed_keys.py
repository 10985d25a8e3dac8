"""Keys that moved: those of the former `trainer` group, split by concern, and the recipe's keys that became the
loss and schedule groups; each gets the one line that names its new place. `fields` → `renamed_keys` → `schema`."""

from __future__ import annotations

import re

# trainer.* held all of the above until it was split by concern; an old key on the command line is named here.
MOVED_KEYS = {
    **{f"trainer.{key}": f"train.{key}" for key in ("epochs", "max_steps", "seed")},
    **{f"trainer.{key}": f"system.{key}" for key in ("device", "precision", "channels_last", "compile")},
    "trainer.deterministic": "system.deterministic",
    "trainer.resume": "checkpoint.resume",
    "trainer.save_checkpoints": "checkpoint.save",
    "trainer.ckpt_every_min": "checkpoint.every_min",
    "trainer.ckpt_every_n_steps": "checkpoint.every_n_steps",
    "trainer.warmup_steps": "metrics.skip_first_steps",
    **{f"trainer.{key}": f"metrics.{key}" for key in ("log_every_n_steps", "progress_bar", "monitor_interval_s")},
    **{f"trainer.{key}": f"metrics.{key}" for key in ("compute_probe", "profile", "profile_steps")},
    "trainer.nonfinite": "faults.nonfinite",
    "trainer.lr_warmup_epochs": "schedule.warmup_epochs",
    "trainer.label_smoothing": "loss.label_smoothing",
    "trainer.dist_timeout_s": "faults.dist_timeout_s",
}

# The recipe's keys that became groups of their own (the loss and the LR schedule are chosen by `_target_` now).
RECIPE_MOVES = {
    "train.label_smoothing": "loss.label_smoothing",
    "train.lr_warmup_epochs": "schedule.warmup_epochs",
}


def moved_key_line(message: str) -> str | None:
    """The line for an error that names a key that moved (its new place), else None."""
    recipe = next((old for old in RECIPE_MOVES if re.search(rf"(?<![\w.]){re.escape(old)}\b", message)), None)
    if recipe is not None:
        return f"{recipe} is now {RECIPE_MOVES[recipe]} (the loss and the LR schedule are groups: loss=, schedule=)"
    names = re.findall(r"(?<![\w.])trainer(?:\.(\w+))?", message)
    if not names:
        return None
    old = next((f"trainer.{key}" for key in names if f"trainer.{key}" in MOVED_KEYS), None)
    split = "trainer.* was split by concern into train, system, checkpoint, metrics and faults"
    if old is None:
        return f"{split}: {', '.join(f'{key} is now {new}' for key, new in MOVED_KEYS.items())}"
    return f"{old} is now {MOVED_KEYS[old]} ({split})"
