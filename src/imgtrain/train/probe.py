"""The model's own images/s: full training steps on a batch already on the device, with no input pipeline.

`data.num_workers=tune` compares every loader against it, and the verdict tells CPU contention from
compute-bound with it (metrics.compute_probe). It must time the model as the run runs it: a copy of the model,
compiled in the run's system.compile_mode (compiled and eager rates can differ widely: BENCHMARKS.md, the H100
ResNet-50 ceilings), stepped by the run's own `Step` (CUDA-graph step marks included), and never a
sync per step, which would leave the GPU idle between steps and read a launch-bound model as slower than it is.

What the probe compiles is its own and goes with it. Dynamo keeps compiled code on the code object of the frame it
compiled and guards a module by its type, not its identity (parameters are graph inputs), so a copy compiled
through the model's own `forward` would leave an entry that the run's model, compiled after it with the same
shapes, runs as its own: under torchrun a graph compiled outside DDP, without DDP's bucket split
(`train.placement.compiled`), and with CUDA graphs the graphs recorded at the copy's parameter addresses, which the
run's model records again beside them. So the copy is compiled through `OwnForward`, a frame only probes run, and
`release` drops that frame's entries alone (`torch._dynamo.reset()` would drop the run's graphs too). The run's
model then traces its own graph, and inductor finds its kernels in its cache (the forward and backward on the CPU).
"""

from __future__ import annotations

import copy
import itertools
import logging
import time
from typing import Any

import torch
from torch import nn
from torch._dynamo.eval_frame import remove_from_cache

from imgtrain.config.schema import Config
from imgtrain.config.system import Precision
from imgtrain.metrics.spread import Rate
from imgtrain.train.placement import compiled
from imgtrain.train.step import Step, build_step

log = logging.getLogger(__name__)

WARMUP_STEPS = 3  # untimed steps of a new probe: compilation, CUDA-graph recording, cuDNN autotuning


class StepClock:
    """Each step's seconds, with no sync per step: on CUDA an event recorded after every step and read once at
    the end (the GPU's own timeline); on the CPU, whose ops finish before they return, the host clock."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.marks: list[Any] = []

    def mark(self) -> None:
        """The end of a step (and the start of the next): queued on the current stream, not waited for."""
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self.marks.append(event)
        else:
            self.marks.append(time.perf_counter())

    def seconds(self) -> list[float]:
        """Seconds of each step between two marks; on CUDA this waits, once, for the last one."""
        if self.cuda and self.marks:
            self.marks[-1].synchronize()
            return [start.elapsed_time(end) / 1000.0 for start, end in itertools.pairwise(self.marks)]
        return [end - start for start, end in itertools.pairwise(self.marks)]


class OwnForward(nn.Module):
    """The probe's copy behind a `forward` of its own: Dynamo compiles this frame (the copy's `forward` inlined
    into it, the same graph) and keeps the result on this code object, which only probes run, never on the
    model's `forward`, where the run's model would find it."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.model(images)


class ModelProbe:
    """Times training steps of a copy of `base`, compiled as the run compiles it, on one random batch of the run's
    shape. Built (and compiled, untimed) on first use or by `ready`; `release` frees what it built (below).
    Calling it gives the median step's images/s with its 95% interval (metrics/spread.py) when at least
    `min_steps` steps ran."""

    def __init__(
        self,
        base: nn.Module,
        num_classes: int,
        settings: Config,
        device: torch.device,
        precision: Precision,
        memory_format: torch.memory_format,
    ) -> None:
        self.base, self.num_classes, self.settings = base, num_classes, settings
        self.device, self.precision, self.memory_format = device, precision, memory_format
        self.parts: tuple[nn.Module, Step, torch.Tensor, torch.Tensor] | None = None
        self.steps = 0  # probe steps taken: mixup/cutmix's and the EMA's step number

    def ready(self) -> None:
        """Build the probe now: its compilation and warm-up steps are not part of any timing."""
        if self.parts is not None:
            return
        copied = copy.deepcopy(self.base).train()  # the run's weights and BatchNorm statistics stay untouched
        # compiled as the run's model, without DDP's collectives, in a frame of its own (OwnForward)
        model = compiled(OwnForward(copied), self.settings.system)
        step = build_step(
            self.settings, copied, self.device, self.precision, (1, 1), num_classes=self.num_classes, announce=False
        )
        size, side = self.settings.data.batch_size, self.settings.dataset.image_size
        images = torch.randn(size, 3, side, side, device=self.device).contiguous(memory_format=self.memory_format)
        labels = torch.randint(0, self.num_classes, (size,), device=self.device)
        self.parts = (model, step, images, labels)
        started = time.perf_counter()
        for _ in range(WARMUP_STEPS):
            self._step()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        log.debug("model probe ready in %.1f s", time.perf_counter() - started)

    def _step(self) -> None:
        """The training loop's own step (optim.Step), on the batch already on the device: mixing, forward, loss,
        backward, update and the EMA's, as the loop takes it."""
        _, _, images, labels = self.parts
        self.step_on(images, labels)

    def step_on(self, images: torch.Tensor, labels: torch.Tensor) -> None:
        """One training step of the copy on a loader's batch (data.num_workers=tune on a GPU: each worker count
        timed training on its own batches), with no sync."""
        self.ready()
        model, step, _, _ = self.parts
        self.steps += 1
        mixed, targets = step.mix(images, labels, self.steps)
        _, loss = step.forward(model, mixed, targets)
        step.update(loss, schedule=False, step=self.steps)

    def __call__(self, seconds: float, min_steps: int = 2) -> Rate:
        self.ready()
        clock = StepClock(self.device)
        clock.mark()
        started = time.perf_counter()
        steps = 0
        while steps < min_steps or time.perf_counter() - started < seconds:
            self._step()
            clock.mark()
            steps += 1
        size = self.settings.data.batch_size
        return Rate.of([size / max(step_s, 1e-9) for step_s in clock.seconds()])

    def release(self) -> None:
        """Free what the probe built; a later call builds it again. Its copy of the model (with its gradients),
        its optimizer and EMA state and its batch go, and so does its compiled code: Dynamo's entries on
        `OwnForward.forward` (guards, the compiled forward and backward), which hold its CUDA-graph functions.

        Not freed: entries on the model's own frames, where a graph break made Dynamo compile them apart (shared
        with the run's model, which runs them too); inductor's loaded kernel modules and Dynamo's counters
        (process-wide, no tensors). With CUDA graphs, the graphs recorded for the probe go with the device's graph
        tree once no compiled function is left (data.num_workers=tune releases the probe before the run's model
        first runs); after training they stay in the tree until the run's `torch._dynamo.reset()` that follows
        (train/run.py): torch frees no single function's graphs."""
        self.parts = None
        if self.settings.system.compile:
            remove_from_cache(OwnForward.forward)  # this frame's entries only: every probe's, no one else's
