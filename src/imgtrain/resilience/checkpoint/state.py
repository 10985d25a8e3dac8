"""What a checkpoint holds besides the weights: where training is, the generators, and a consistent copy of
the state in host memory that a background writer can save while training goes on."""

from __future__ import annotations

import random
from collections import OrderedDict
from dataclasses import dataclass, field, fields
from typing import Any

import numpy as np
import torch

from imgtrain.config import val_metrics
from imgtrain.resilience.faults import FaultCounts


@dataclass
class Progress:
    """Where training is: saved in every checkpoint, restored on resume. Only the loop writes it, through these
    methods and its validation figures; the checkpointer reads it to save (Faults own the fault counts)."""

    step: int = 0  # optimizer steps taken (the same on every rank); TensorBoard's x axis
    epoch: int = 0  # the current epoch, counted from 0
    samples_in_epoch: int = 0  # samples of `epoch`'s order already trained on, over all ranks the sampler shards to
    # the best epoch's val_acc (config/val_metrics.py's BEST), and its EMA's (train.ema_decay)
    best_val_acc: float | None = None
    best_val_acc_ema: float | None = None
    val: dict[str, float] = field(default_factory=dict)
    replicas: int = field(default=1, metadata={"saved": False})  # ranks the order is sharded over (not saved)

    def begin_epoch(self, epoch: int) -> None:
        if epoch != self.epoch:
            self.epoch, self.samples_in_epoch = epoch, 0

    def advance(self, batch_images: int) -> None:
        """One optimizer step of `batch_images` images on this rank."""
        self.step += 1
        self.samples_in_epoch += batch_images * self.replicas

    def end_epoch(self) -> None:
        self.epoch, self.samples_in_epoch = self.epoch + 1, 0

    def validated(self, val: dict[str, float], ema_best: bool = False) -> bool:
        """Record an epoch's validation figures and the best so far; whether the figure best.pt follows improved:
        the model's accuracy, or with `ema_best` (checkpoint.best_of=ema) its EMA's."""
        self.val = val
        improved = {}
        for ema in (False, True):
            figure, best = (
                val.get(val_metrics.field(val_metrics.BEST, ema)),
                val_metrics.best_field(ema),
            )  # the EMA's: absent without one
            improved[ema] = figure is not None and (getattr(self, best) is None or figure > getattr(self, best))
            if improved[ema]:
                setattr(self, best, figure)
        return improved[ema_best]


def progress_from(payload: dict[str, Any], replicas: int = 1) -> tuple[Progress, FaultCounts]:
    """The position and the fault counts a checkpoint saved (one `progress` entry, as saved since format 1)."""
    saved = payload["progress"]
    counts = FaultCounts(**{name: saved[name] for name in FaultCounts.__dataclass_fields__ if name in saved})
    position = {name: value for name, value in saved.items() if name not in FaultCounts.__dataclass_fields__}
    return Progress(**position, replicas=replicas), counts


def progress_dict(progress: Progress, counts: FaultCounts) -> dict[str, Any]:
    """What a checkpoint's `progress` entry holds: the position and the fault counts."""
    saved = [(f.name, getattr(progress, f.name)) for f in fields(progress) if f.metadata.get("saved", True)]
    saved += [(f.name, getattr(counts, f.name)) for f in fields(counts)]
    return {name: _plain(value) for name, value in saved}


def _plain(value: Any) -> Any:
    return dict(value) if isinstance(value, dict) else value  # a copy: the writer thread must not see it change


# ----------------------------------------------------------------------------- random number generators
def capture_rng() -> dict[str, Any]:
    """Python, NumPy, torch CPU and CUDA generator states, in types torch.load(weights_only=True) accepts."""
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    state = {
        "python": random.getstate(),
        "numpy": {"kind": kind, "keys": torch.from_numpy(keys.astype(np.int64)), "pos": int(pos)},
        "numpy_gauss": (int(has_gauss), float(cached)),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng(state: dict[str, Any]) -> None:
    """Put every generator back where `capture_rng` found it."""
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    numpy = state["numpy"]
    has_gauss, cached = state["numpy_gauss"]
    keys = numpy["keys"].numpy().astype(np.uint32)
    np.random.set_state((numpy["kind"], keys, numpy["pos"], has_gauss, cached))
    torch.set_rng_state(state["torch"].cpu())
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([s.cpu() for s in state["cuda"]])


# ----------------------------------------------------------------------------- the snapshot
class HostSnapshot:
    """A copy of a state tree (nested dicts, lists and tuples of tensors) in host memory, for a background writer.

    The training thread only queues the copies: on CUDA into pinned buffers, asynchronously, ordered before
    the next update on the same stream; `ready()` (called by the writer thread) waits for them. The buffers
    are kept and reused by the next snapshot, which the checkpointer takes only once the previous write is
    done: one extra copy of the model and optimizer state in host memory, allocated once.
    """

    def __init__(self) -> None:
        self.buffers: list[torch.Tensor] = []
        self._used = 0
        self._copied: torch.cuda.Event | None = None
        self._device: torch.device | None = None  # the CUDA device copied from, if any

    def take(self, tree: Any) -> Any:
        """`tree` with every tensor replaced by its copy in host memory."""
        self._used, self._copied, self._device = 0, None, None
        copy = self._copy(tree)
        if self._device is not None:  # one event after the last copy: the writer waits for it, not this thread
            self._copied = torch.cuda.Event()
            self._copied.record(torch.cuda.current_stream(self._device))
        return copy

    def ready(self) -> None:
        """Wait until the device-to-host copies are complete (in the writer thread: training goes on)."""
        if self._copied is not None:
            self._copied.synchronize()

    def _copy(self, value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            return self._tensor(value)
        if isinstance(value, dict):
            out = OrderedDict() if isinstance(value, OrderedDict) else {}
            out.update((key, self._copy(item)) for key, item in value.items())
            if hasattr(value, "_metadata"):  # state_dict's per-module versions, which load_state_dict reads
                out._metadata = value._metadata
            return out
        if isinstance(value, tuple) and hasattr(value, "_fields"):  # a namedtuple takes its fields one by one
            return type(value)(*(self._copy(item) for item in value))
        if isinstance(value, (list, tuple)):
            return type(value)(self._copy(item) for item in value)
        return value  # numbers, strings, None: immutable

    def _tensor(self, tensor: torch.Tensor) -> torch.Tensor:
        index, self._used = self._used, self._used + 1
        cuda = tensor.device.type == "cuda"
        buffer = self.buffers[index] if index < len(self.buffers) else None
        if buffer is None or buffer.shape != tensor.shape or buffer.dtype != tensor.dtype:
            buffer = torch.empty_like(tensor, device="cpu", pin_memory=cuda)  # keeps the strides
            if index < len(self.buffers):
                self.buffers[index] = buffer
            else:
                self.buffers.append(buffer)
        buffer.copy_(tensor.detach(), non_blocking=cuda)
        if cuda:
            self._device = tensor.device
        return buffer
