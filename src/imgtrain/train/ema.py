"""An exponential moving average of the weights (train.ema_decay, train.ema_every_n_steps): torch's
swa_utils.AveragedModel with its EMA function, over the parameters and the buffers (BatchNorm statistics, as
torchvision's reference's ExponentialMovingAverage does), validated beside the model and kept in the checkpoint."""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import torch
from torch import nn
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn


class WeightAverage:
    """The EMA of `base` (the underlying module, not its DDP or compiled wrapper), updated after every `every`-th
    optimizer step: ema = decay x ema + (1 - decay) x weights; the first update copies the weights."""

    def __init__(self, base: nn.Module, decay: float, every: int) -> None:
        self.base, self.every = base, every
        self.averaged = AveragedModel(base, multi_avg_fn=get_ema_multi_avg_fn(decay), use_buffers=True)
        self.averaged.eval()  # only ever validated
        # (averaged, current) tensor lists per device and dtype, paired once: the tensors are updated in place (by
        # the optimizer, BatchNorm and load_state_dict), so the same lists serve every update
        groups: dict[tuple[torch.device, torch.dtype], tuple[list, list]] = defaultdict(lambda: ([], []))
        for mine, theirs in zip(_tensors(self.averaged.module), _tensors(base), strict=True):
            group = groups[(mine.device, mine.dtype)]
            group[0].append(mine)
            group[1].append(theirs)
        # averaged (a lerp) where the dtype is floating or complex, as torch's EMA function averages; else copied
        self.groups = [(*group, dtype.is_floating_point or dtype.is_complex) for (_, dtype), group in groups.items()]

    @property
    def module(self) -> nn.Module:
        """The averaged copy of the model, to validate (eagerly: it is never compiled)."""
        return self.averaged.module

    @torch.no_grad()
    def after_step(self, step: int) -> None:
        """After optimizer step `step` (counted from 1): update every `every` steps, one foreach call per device and
        dtype: a copy the first time, then torch's EMA (`multi_avg_fn`: one foreach lerp) for floating tensors, a
        copy for integer ones (BatchNorm's num_batches_tracked, a count: its average would be truncated).

        AveragedModel.update_parameters does this but moves its step counter, a CPU tensor, to the GPU on every
        call: a blocking copy, which waits for the GPU (a sync per update); its EMA function also averages integer
        tensors one at a time (4 ops each: 80 of ResNet-18's 83 ops per update). Here the counter stays on the CPU."""
        if step % self.every:
            return
        first = int(self.averaged.n_averaged) == 0  # the CPU counter: no sync
        for averaged, current, averages in self.groups:
            if first or not averages:
                torch._foreach_copy_(averaged, current)  # one multi-tensor copy, as torch.optim foreach paths use
            else:
                self.averaged.multi_avg_fn(averaged, current, None)
        self.averaged.n_averaged += 1

    def synced(self) -> nn.Module:
        """The module to validate, its buffers made rank 0's under DDP: each rank's BatchNorm statistics (and so
        their averages) differ after DDP's per-forward broadcast, and the checkpoint holds rank 0's."""
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            for buffer in self.module.buffers():
                torch.distributed.broadcast(buffer, src=0)
        return self.module

    def state_dict(self) -> dict[str, Any]:
        """For the checkpoint: `ema` is a state_dict of the model itself (model.load_state_dict(checkpoint["ema"])
        gives the averaged weights), `ema_updates` the updates it has had."""
        return {"ema": self.module.state_dict(), "ema_updates": self.averaged.n_averaged}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.module.load_state_dict(state["ema"])
        self.averaged.n_averaged.copy_(state["ema_updates"])


def _tensors(module: nn.Module) -> list[torch.Tensor]:
    """Parameters then buffers, as AveragedModel(use_buffers=True) pairs them."""
    return [tensor.detach() for tensor in (*module.parameters(), *module.buffers())]
