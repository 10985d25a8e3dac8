"""The update: optimiser (fused), the warmup-then-cosine LR schedule, the loss scaler, and autocast."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from hydra.utils import instantiate
from torch import nn

from imgtrain.config.schema import Config, Precision

Mark = Callable[[str], contextlib.AbstractContextManager]  # labels a phase in a profiler trace (Profiler.range)


def _unmarked(name: str) -> contextlib.AbstractContextManager:
    return contextlib.nullcontext()


DTYPES = {Precision.fp32: torch.float32, Precision.bf16: torch.bfloat16, Precision.fp16: torch.float16}


@dataclass
class Step:
    """What the loop needs besides the model and the data: built once, used every step."""

    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    scaler: torch.amp.GradScaler  # enabled for fp16 only
    device_type: str
    dtype: torch.dtype
    label_smoothing: float
    cuda_graphs: bool = False  # the compiled model replays CUDA graphs (system.compile_mode): mark each step

    def begin(self) -> None:
        """Start a step. With CUDA graphs, tell torch.compile a new iteration begins: a graph replay overwrites the
        previous replay's outputs, which is safe only once nothing reads them any more. Called before every forward
        (training, nonfinite=skip's forward with no backward, the tune probe), never inside the step."""
        if self.cuda_graphs:
            torch.compiler.cudagraph_mark_step_begin()

    def autocast(self) -> contextlib.AbstractContextManager:
        return torch.autocast(self.device_type, dtype=self.dtype, enabled=self.dtype != torch.float32)

    def forward(
        self, model: nn.Module, images: torch.Tensor, labels: torch.Tensor, mark: Mark = _unmarked
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The forward pass and the loss in the run's precision: (logits, loss). The training loop and the
        tune probe (`tune.compute_rate`) both step through here and `update`, so the probe times the same step."""
        self.begin()
        with self.autocast(), mark("forward"):
            logits = model(images)
            loss = F.cross_entropy(logits, labels, label_smoothing=self.label_smoothing)
        return logits, loss

    def update(self, loss: torch.Tensor, mark: Mark = _unmarked, schedule: bool = True) -> None:
        """Backward, then one optimizer step (through the loss scaler: a no-op unless fp16) and, with `schedule`,
        one LR-schedule step (the probe's copy has no schedule to follow)."""
        self.optimizer.zero_grad(set_to_none=True)
        with mark("backward"):
            self.scaler.scale(loss).backward()
        with mark("optimizer"):
            self.scaler.step(self.optimizer)
            self.scaler.update()
            if schedule:
                self.scheduler.step()

    def state_dict(self) -> dict[str, Any]:
        """Optimizer, LR schedule and loss-scaler state, for checkpoints."""
        return {
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "scaler": self.scaler.state_dict(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        if state["scaler"]:  # empty when the scaler was off (fp32/bf16)
            self.scaler.load_state_dict(state["scaler"])


def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """Split parameters so weight decay skips BatchNorm weights and biases (1-d tensors), as timm does."""
    decay, no_decay = [], []
    for param in model.parameters():
        if param.requires_grad:
            (no_decay if param.ndim <= 1 else decay).append(param)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def warmup_cosine(
    optimizer: torch.optim.Optimizer, warmup_steps: int, total_steps: int
) -> torch.optim.lr_scheduler.LRScheduler:
    """Linear warmup from base/warmup to the base LR over `warmup_steps`, then cosine decay to zero at
    `total_steps`: PyTorch's SequentialLR(LinearLR, CosineAnnealingLR)."""
    cosine_steps = max(1, total_steps - warmup_steps)
    cosine = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=cosine_steps, eta_min=0.0)
    if warmup_steps == 0:
        return cosine
    # step k of the warmup: base x (k + 1) / warmup_steps, reaching the base LR at its last step
    linear = torch.optim.lr_scheduler.LinearLR(
        optimizer, start_factor=1.0 / warmup_steps, end_factor=1.0, total_iters=max(1, warmup_steps - 1)
    )
    return torch.optim.lr_scheduler.SequentialLR(optimizer, [linear, cosine], milestones=[warmup_steps])


def build_step(
    settings: Config, base: nn.Module, device: torch.device, precision: Precision, steps: tuple[int, int]
) -> Step:
    """Optimiser, LR schedule and scaler for `base`'s parameters; `steps` is (steps per epoch, total steps)."""
    # fused=True: one kernel for the whole update instead of a few per parameter tensor, with no temporaries.
    # On an H100, AdamW on ResNet-18 at 32 px: 30.8k -> 47.8k img/s in a bare loop. On CPU (2 cores), the
    # single-tensor AdamW's two full-size temporaries per tensor page-fault on every step, as much as glibc's heap
    # state decides: train.py went from 575 to 750 img/s and its gap to the bare loop from 5-11% to ~3%
    # (BENCHMARKS.md, 2026-11-24).
    params, system = param_groups(base, settings.optim.weight_decay), settings.system
    optimizer = instantiate(settings.optim, params=params, _convert_="all", fused=True)
    steps_per_epoch, total_steps = steps
    warmup = round(settings.train.lr_warmup_epochs * steps_per_epoch)
    return Step(
        optimizer=optimizer,
        scheduler=warmup_cosine(optimizer, warmup, total_steps),
        scaler=torch.amp.GradScaler(device.type, enabled=precision == Precision.fp16),
        device_type=device.type,
        dtype=DTYPES[precision],
        label_smoothing=settings.train.label_smoothing,
        cuda_graphs=system.compile and system.compile_mode.records_cuda_graphs and device.type == "cuda",
    )
