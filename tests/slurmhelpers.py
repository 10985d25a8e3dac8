"""What the Slurm tests' jobs train: a model of milliseconds per step that, in a job's first attempt only, can be
made slow or stall, so that a signal, a requeue or a time limit reaches it mid-run.

Used as `model._target_=slurmhelpers.paced_cnn` with tests/ on PYTHONPATH (sbatch passes the environment on):
IMGTRAIN_TEST_STEP_S sleeps that many seconds in each training step, IMGTRAIN_TEST_STALL_AT_STEP stalls for good
in that training step (1-based), as a hung step would; a requeued attempt (SLURM_RESTART_COUNT > 0) runs at full
speed. Neither changes a number: the weights, the data and the random draws are the plain model's.
"""

from __future__ import annotations

import os
import time

import torch
from torch import nn

STALL_S = 3600.0  # "for good": the job's time limit or a kill ends it first


def first_attempt() -> bool:
    return os.environ.get("SLURM_RESTART_COUNT", "0") in ("", "0")


class Paced(nn.Module):
    def __init__(self, net: nn.Module, step_s: float, stall_at: int) -> None:
        super().__init__()
        self.net, self.step_s, self.stall_at, self.steps = net, step_s, stall_at, 0

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        if self.training and first_attempt():
            self.steps += 1
            time.sleep(STALL_S if self.steps == self.stall_at else self.step_s)
        return self.net(images)


def paced_cnn(num_classes: int, **torchvision_keys: object) -> nn.Module:
    """A tiny CNN, paced by IMGTRAIN_TEST_STEP_S and IMGTRAIN_TEST_STALL_AT_STEP; `torchvision_keys` unused."""
    net = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                        nn.Linear(8, num_classes))  # fmt: skip
    step_s = float(os.environ.get("IMGTRAIN_TEST_STEP_S", "0"))
    return Paced(net, step_s, int(os.environ.get("IMGTRAIN_TEST_STALL_AT_STEP", "0")))
