"""Keys of the former `trainer` group: where each one went when it was split by concern, for the one line
that names an old key's new place. `fields` → `renamed_keys` → `schema`."""

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


def moved_key_line(message: str) -> str | None:
    """The line for an error that names a key of the former `trainer` group (its new place), else None."""
    names = re.findall(r"(?<![\w.])trainer(?:\.(\w+))?", message)
    if not names:
        return None
    old = next((f"trainer.{key}" for key in names if f"trainer.{key}" in MOVED_KEYS), None)
    split = "trainer.* was split by concern into train, system, checkpoint, metrics and faults"
    if old is None:
        return f"{split}: {', '.join(f'{key} is now {new}' for key, new in MOVED_KEYS.items())}"
    return f"{old} is now {MOVED_KEYS[old]} ({split})"
