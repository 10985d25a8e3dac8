"""The `checkpoint` group's schema (conf/checkpoint/): saving and resuming."""

from __future__ import annotations

import os
from dataclasses import dataclass

from imgtrain.config.fields import AUTO, Choice, at_least, checked


class BestOf(Choice):
    """Which weights best.pt keeps (checkpoint.best_of) when train.ema_decay is set."""

    model = "model"  # the trained weights, by their val_acc
    ema = "ema"  # their exponential moving average, by its val_acc_ema


def _resume(value: str) -> str | None:
    if value in (AUTO, "none") or os.path.isfile(os.path.expanduser(value)):
        return None
    return "expected auto, none or the path of an existing checkpoint file"


_MINUTES = "expected minutes > 0, or null (save at every epoch end instead)"


@dataclass
class CheckpointConfig:
    """Saving and resuming. checkpoint.<key>=..."""

    resume: str = checked(AUTO, _resume)  # auto: the run directory's checkpoints/last.pt, if any; none; a path
    save: bool = True  # last.pt, last.prev.pt and best.pt under <run dir>/checkpoints (mode=train)
    # last.pt every this many minutes of wall time (rank 0's clock, checked at log windows), written in the
    # background; epoch ends save on the same clock (null: at every epoch end). Also saved: when validation
    # improves (best.pt), at the end of the run and on a stop signal.
    every_min: float | None = checked(10.0, lambda v: None if v is None or v > 0 else _MINUTES)
    every_n_steps: int = checked(0, at_least(0, note="0 = off"))  # also every this many steps
    best_of: BestOf = BestOf.model  # with train.ema_decay: best.pt keeps the best model, or the best EMA
