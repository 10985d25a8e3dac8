"""LR schedules of the `schedule` group: builders that `build_step` calls with the optimizer, the steps per epoch and
the run's total steps, and the group's own keys. Each steps once per optimizer step (PyTorch's LR schedulers).

A schedule of your own: a function taking (optimizer, *, steps_per_epoch, total_steps, <your keys>) and returning a
torch.optim.lr_scheduler.LRScheduler, named by `_target_` in conf/schedule/<name>.yaml."""

from __future__ import annotations

from torch.optim import Optimizer
from torch.optim.lr_scheduler import CosineAnnealingLR, LinearLR, LRScheduler, SequentialLR, StepLR


def warmup_cosine(optimizer: Optimizer, *, steps_per_epoch: int, total_steps: int, warmup_epochs: float) -> LRScheduler:
    """Linear warm-up from base/warmup to the base LR over `warmup_epochs`, then a cosine to zero at `total_steps`:
    SequentialLR(LinearLR, CosineAnnealingLR)."""
    warmup_steps = round(warmup_epochs * steps_per_epoch)
    cosine = CosineAnnealingLR(optimizer, T_max=max(1, total_steps - warmup_steps), eta_min=0.0)
    return _after_warmup(optimizer, cosine, warmup_steps)


def warmup_step(
    optimizer: Optimizer,
    *,
    steps_per_epoch: int,
    total_steps: int,
    warmup_epochs: float,
    step_epochs: float,
    gamma: float,
) -> LRScheduler:
    """Linear warm-up over `warmup_epochs`, then the LR times `gamma` every `step_epochs` epochs counted from the end of
    the warm-up (torchvision's reference: StepLR after its warm-up), in steps: SequentialLR(LinearLR, StepLR).
    `total_steps` is unused: the drops come at fixed epochs however long the run is."""
    warmup_steps = round(warmup_epochs * steps_per_epoch)
    decay = StepLR(optimizer, step_size=max(1, round(step_epochs * steps_per_epoch)), gamma=gamma)
    return _after_warmup(optimizer, decay, warmup_steps)


def _after_warmup(optimizer: Optimizer, then: LRScheduler, warmup_steps: int) -> LRScheduler:
    """`then` after a linear warm-up of `warmup_steps`: step k of it is base x (k + 1) / warmup_steps, reaching the
    base LR at its last step."""
    if warmup_steps == 0:
        return then
    linear = LinearLR(optimizer, start_factor=1.0 / warmup_steps, end_factor=1.0, total_iters=max(1, warmup_steps - 1))
    return SequentialLR(optimizer, [linear, then], milestones=[warmup_steps])
