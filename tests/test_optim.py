"""The update: the warm-up-then-cosine LR schedule (PyTorch's SequentialLR) and weight-decay groups."""

from __future__ import annotations

import math

import pytest
import torch

from imgtrain.train.schedules import warmup_cosine
from imgtrain.train.step import param_groups


def _closed_form(step: int, warmup: int, total: int) -> float:
    """The schedule as specified: base x (k + 1) / warmup during warmup, then a cosine to zero at `total`."""
    if step < warmup:
        return (step + 1) / warmup
    return 0.5 * (1.0 + math.cos(math.pi * min(1.0, (step - warmup) / max(1, total - warmup))))


@pytest.mark.parametrize(("warmup", "total"), [(5, 40), (0, 20), (1, 20), (2, 10), (10, 12)])
def test_lr_warms_up_linearly_then_follows_a_cosine(warmup: int, total: int) -> None:
    weight = torch.nn.Parameter(torch.zeros(1))
    optimizer = torch.optim.SGD([weight], lr=1.0)
    scheduler = warmup_cosine(optimizer, steps_per_epoch=1, total_steps=total, warmup_epochs=warmup)
    for step in range(total):
        assert optimizer.param_groups[0]["lr"] == pytest.approx(_closed_form(step, warmup, total), abs=1e-12), step
        optimizer.step()
        scheduler.step()


def test_weight_decay_skips_batchnorm_and_biases() -> None:
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.BatchNorm2d(4), torch.nn.Linear(4, 2))
    decay, no_decay = param_groups(model, 0.05)
    assert decay["weight_decay"] == 0.05 and no_decay["weight_decay"] == 0.0
    assert [p.ndim for p in decay["params"]] == [4, 2] and all(p.ndim == 1 for p in no_decay["params"])
