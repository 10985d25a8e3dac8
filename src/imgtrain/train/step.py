"""The update: the optimiser (any torch.optim class, fused where it can be), the LR schedule, the loss, mixup/cutmix,
the weights' EMA, the loss scaler and autocast. The optimiser, loss and schedule are the `optim`, `loss` and
`schedule` groups' `_target_`s; a fork changes them in conf/, not here."""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import logging
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from hydra.utils import get_class, instantiate
from torch import nn

from imgtrain.config.schema import Config
from imgtrain.config.system import Precision
from imgtrain.train.ema import WeightAverage
from imgtrain.train.mixing import Mixing

log = logging.getLogger(__name__)

Mark = Callable[[str], contextlib.AbstractContextManager]  # labels a phase in a profiler trace (Profiler.range)


def _unmarked(name: str) -> contextlib.AbstractContextManager:
    return contextlib.nullcontext()


DTYPES = {Precision.fp32: torch.float32, Precision.bf16: torch.bfloat16, Precision.fp16: torch.float16}
LR_BATCH = 256  # optim.scale_lr_with_batch=true: lr x global batch / 256 (Goyal et al., 2017)


@dataclass
class Step:
    """What the loop needs besides the model and the data: built once, used every step."""

    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    scaler: torch.amp.GradScaler  # enabled for fp16 only
    device_type: str
    dtype: torch.dtype
    loss: nn.Module  # the `loss` group's: (logits, class indices [B] or probabilities [B, C]) -> mean loss
    mix: Mixing  # mixup/cutmix: `mix(images, labels, step) -> (images, targets)`, the identity when off
    ema: WeightAverage | None = None  # train.ema_decay: the weights' moving average
    cuda_graphs: bool = False  # the compiled model replays CUDA graphs (system.compile_mode): mark each step
    steps_per_epoch: int = 1  # the schedule's steps per epoch at this run's batch size: where a resumed run is

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.optimizer.param_groups

    def begin(self) -> None:
        """Start a step. With CUDA graphs, tell torch.compile a new iteration begins: a graph replay overwrites the
        previous replay's outputs, which is safe only once nothing reads them any more. Called before every forward
        (training, nonfinite=skip's forward with no backward, the tune probe), never inside the step."""
        if self.cuda_graphs:
            torch.compiler.cudagraph_mark_step_begin()

    def autocast(self) -> contextlib.AbstractContextManager:
        return torch.autocast(self.device_type, dtype=self.dtype, enabled=self.dtype != torch.float32)

    def forward(
        self, model: nn.Module, images: torch.Tensor, targets: torch.Tensor, mark: Mark = _unmarked
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The forward pass and the loss in the run's precision: (logits, loss). `targets`: class indices, or mixup's
        probabilities. The training loop and the tune probe (`tune.compute_rate`) both step through here and
        `update`, so the probe times the same step."""
        self.begin()
        with self.autocast(), mark("forward"):
            logits = model(images)
            loss = self.loss(logits, targets)
        return logits, loss

    def update(self, loss: torch.Tensor, mark: Mark = _unmarked, schedule: bool = True, step: int = 0) -> None:
        """Backward, then one optimizer step (through the loss scaler: a no-op unless fp16), with `schedule` one
        LR-schedule step (the probe's copy has no schedule to follow), and the EMA's update when optimizer step
        `step` (counted from 1; 0: none) is one of train.ema_every_n_steps."""
        self.optimizer.zero_grad(set_to_none=True)
        with mark("backward"):
            self.scaler.scale(loss).backward()
        with mark("optimizer"):
            self.scaler.step(self.optimizer)
            self.scaler.update()
            if schedule:
                self.scheduler.step()
            if self.ema is not None and step:
                self.ema.after_step(step)

    def state_dict(self) -> dict[str, Any]:
        """Optimizer (its class named), loss-scaler and EMA state, for checkpoints. Not the LR schedule: a resumed run
        follows its own config's schedule, positioned by `resume_schedule`."""
        return {
            "optimizer": self.optimizer.state_dict(),
            "optimizer_class": class_name(type(self.optimizer)),
            "scaler": self.scaler.state_dict(),
            **(self.ema.state_dict() if self.ema is not None else {}),
        }

    def load_state_dict(self, state: dict[str, Any]) -> str | None:
        """The checkpoint's optimizer moments (with this run's hyperparameters), scaler and EMA. Returns why the
        moments were not carried over (another optimizer class), or None."""
        fresh = self._load_optimizer(state)
        if state["scaler"]:  # empty when the scaler was off (fp32/bf16)
            self.scaler.load_state_dict(state["scaler"])
        if self.ema is not None and "ema" in state:
            self.ema.load_state_dict(state)
        elif self.ema is not None:
            log.warning("the checkpoint has no EMA of the weights: the EMA starts from the resumed weights")
        return fresh

    def _load_optimizer(self, state: dict[str, Any]) -> str | None:
        """Only the buffers (moments, step counts) come from the checkpoint: every param-group hyperparameter (lr,
        weight decay, betas, momentum, ...) stays what this run's config and fresh schedule set, so a resumed run
        with another optim.lr or optim.weight_decay trains with it. Another optimizer class starts fresh: AdamW's
        moments mean nothing to SGD (and its groups lack SGD's keys: a KeyError at the first step)."""
        ours, groups = class_name(type(self.optimizer)), state["optimizer"]["param_groups"]
        theirs = state.get("optimizer_class") or _class_by_keys(groups, self.param_groups, ours)
        if theirs != ours:
            mine, saved = ours.rsplit(".", 1)[-1], theirs.rsplit(".", 1)[-1]
            return f"the checkpoint's optimizer is {saved}, this run's {mine}: {mine} starts with fresh state"
        configured = [{key: value for key, value in group.items() if key != "params"} for group in self.param_groups]
        self.optimizer.load_state_dict(state["optimizer"])
        for group, settings in zip(self.optimizer.param_groups, configured, strict=True):
            group.update(settings)
        return None

    def resume_schedule(self, position: int) -> None:
        """Put this run's LR schedule (built fresh from its config) at optimizer step `position` of it, as if it had
        stepped there: replaying its steps is the one way that works for any LRScheduler, a fork's own included
        (one timing, not a benchmark: SequentialLR(LinearLR, CosineAnnealingLR), 100k steps at 2.8 us a step on the
        2-core development machine while other work shared it; at that rate 450k steps, 90 ImageNet epochs at batch
        256, take 1.3 s). The loop's
        order check (scheduler before optimizer) does not apply to a replay."""
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=r"Detected call of `lr_scheduler\.step\(\)` before")
            for _ in range(position):
                self.scheduler.step()


def class_name(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def _class_by_keys(saved: list[dict], ours: list[dict], name: str) -> str:
    """A checkpoint that does not name its optimizer's class (written before it did): the same class when its
    param groups have the same hyperparameter keys as this run's."""
    keys = lambda groups: {key for group in groups for key in group} - {"params", "initial_lr"}  # noqa: E731
    return name if keys(saved) == keys(ours) else "another optimizer (its param groups have other keys)"


def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """Split parameters so weight decay skips BatchNorm weights and biases (1-d tensors), as timm does."""
    decay, no_decay = [], []
    for param in model.parameters():
        if param.requires_grad:
            (no_decay if param.ndim <= 1 else decay).append(param)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def build_optimizer(optim: Any, base: nn.Module, global_batch: int, announce: bool = True) -> torch.optim.Optimizer:
    """The `optim` group's optimizer (its schema, or a fork's plain file) for `base`'s parameters, its keys checked
    by `validate`: lr scaled with the global batch when asked (said in the log), weight decay off for BatchNorm
    weights and biases where the optimizer has weight decay, and fused where it has a fused kernel."""
    keys = dataclasses.asdict(optim) if dataclasses.is_dataclass(optim) else dict(optim)
    cls, lr = get_class(keys.pop("_target_")), keys["lr"]
    if keys.pop("scale_lr_with_batch", False):  # ours, not the optimizer's
        keys["lr"] = lr * global_batch / LR_BATCH
        if announce:
            said = (keys["lr"], lr, global_batch, LR_BATCH)
            log.info("lr %g = optim.lr %g x global batch %d / %d (optim.scale_lr_with_batch=true)", *said)
    taken = inspect.signature(cls).parameters
    params: Any = [param for param in base.parameters() if param.requires_grad]
    if "weight_decay" in taken:
        params = param_groups(base, keys.get("weight_decay", taken["weight_decay"].default))
    if "fused" in taken and "fused" not in keys:  # the classes that have a fused kernel (SGD, Adam, AdamW, ...)
        # fused=True: one kernel for the whole update instead of a few per parameter tensor, with no temporaries.
        # On an H100, AdamW on ResNet-18 at 32 px: 30.8k -> 47.8k img/s in a bare loop. On CPU (2 cores), the
        # single-tensor AdamW's two full-size temporaries per tensor page-fault on every step, as much as glibc's
        # heap state decides: train.py went from 575 to 750 img/s and its gap to the bare loop from 5-11% to ~3%
        # (BENCHMARKS.md, 2026-11-24).
        keys["fused"] = True
    return cls(params, **keys)


def build_step(
    settings: Config,
    base: nn.Module,
    device: torch.device,
    precision: Precision,
    steps: tuple[int, int],
    *,
    num_classes: int | None = None,
    world_size: int = 1,
    announce: bool = True,
    memory_format: torch.memory_format | None = None,
) -> Step:
    """Optimiser, LR schedule, loss, mixing, EMA and scaler for `base`'s parameters; `steps` is (steps per epoch,
    total steps). `num_classes`: for mixup/cutmix's labels; `world_size`: for the global batch of
    optim.scale_lr_with_batch; `announce`: log the scaled lr (the run's step does, the probe's copy does not);
    `memory_format`: the model's, which mixed batches keep (None: the layout each batch arrives in)."""
    global_batch = settings.data.batch_size * world_size
    optimizer = build_optimizer(settings.optim, base, global_batch, announce)
    steps_per_epoch, total_steps = steps
    scheduler = instantiate(
        settings.schedule, optimizer=optimizer, steps_per_epoch=steps_per_epoch, total_steps=total_steps
    )
    system, train = settings.system, settings.train
    ema = None if train.ema_decay is None else WeightAverage(base, train.ema_decay, train.ema_every_n_steps)
    return Step(
        optimizer=optimizer,
        scheduler=scheduler,
        scaler=torch.amp.GradScaler(device.type, enabled=precision == Precision.fp16),
        device_type=device.type,
        dtype=DTYPES[precision],
        loss=instantiate(settings.loss),  # validation's loss stays plain cross-entropy (config/val_metrics.py)
        mix=Mixing(train, num_classes, memory_format),
        ema=ema,
        cuda_graphs=system.compile and system.compile_mode.records_cuda_graphs and device.type == "cuda",
        steps_per_epoch=steps_per_epoch,
    )
