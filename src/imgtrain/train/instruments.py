"""The one seam between training and measuring: the hooks the loop calls on whatever measures the run.

An instrument (the metrics, the profiler, a fork's own) defines the hooks it needs, by name, from `Instrument`;
`Instruments` fans each hook out to those that define it, in the order `run` lists them. The loop knows nothing
else of measuring, and trains the same with any of them removed, or none. What the ranks must agree on (stops,
NaN losses, the checkpoint clock) is not measuring: the loop exchanges it itself once per logging window
(`resilience.agreement.LoggingWindows`) and hands the agreed record to `on_window`.

`metrics/`'s instruments sit below `train/` in the package order, so they cannot subclass `Instrument`: they
define the same hook names (tests/test_instruments.py checks that each is one of these).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from imgtrain.config.val_metrics import summary_fields
from imgtrain.resilience.agreement import Agreement
from imgtrain.resilience.checkpoint import Progress

Mark = Callable[[str], contextlib.AbstractContextManager]
_NOTHING = contextlib.nullcontext()  # stateless, so one instance serves every range


def no_range(name: str) -> contextlib.AbstractContextManager:
    """A labelled range that marks nothing (no instrument marks ranges, or validation)."""
    return _NOTHING


@dataclass
class RunEnd:
    """What the instruments' summaries are made from, after the last step."""

    progress: Progress
    precision: str
    loader_args: dict
    started: float  # time.perf_counter() at the run's start: the wall time is read after any probe below
    # The model's own rate (a `metrics.spread.Rate`, or None: not measured), given this rank's steady data-wait
    # share (None: not measured) and the CPU cores its loading kept busy: the tune probe's, or timed on demand.
    own_rate: Callable[[float | None, float], Any]


class Instrument:
    """The hooks, each a no-op here; an instrument defines those it needs. Per step only `on_step_end` runs (and
    `on_batch`, `range`); no hook may sync the GPU but `window_report`, once per logging window."""

    def on_run_start(self, start_step: int, total_steps: int, lr: Callable[[], float]) -> None:
        """Training starts after step `start_step` (a resumed run's) and ends at `total_steps`; `lr` reads it."""

    def on_run_end(self) -> None:
        """Training ended, well or not (called in a `finally`, last instrument first): stop threads, close files."""

    def on_epoch_start(self, epoch: int, steps: int) -> None:
        """An epoch of `steps` batches (per rank) starts."""

    def on_batch(self, wait: float, transfer: float, times: tuple) -> None:
        """A batch arrived after the loop blocked `wait` s, `transfer` s of it after its worker had finished it,
        with the stage times its worker stamped on it (`data.stages.BatchTimes`; empty when unstamped)."""

    def range(self, name: str) -> contextlib.AbstractContextManager:
        """A labelled range of the step (`data_wait`, `h2d`, `forward`, `backward`, `optimizer`)."""
        return _NOTHING

    def on_step_end(self, step: int, loss: torch.Tensor, logits: torch.Tensor, labels: torch.Tensor) -> None:
        """Step `step` ended: its loss and logits still on the device (reading them back here is a sync)."""

    def window_ends(self) -> tuple[int, ...]:
        """Steps after which this instrument needs a logging window to end besides every
        metrics.log_every_n_steps (the metrics: the end of the warm-up)."""
        return ()

    def window_report(self, step: int) -> dict[str, float]:
        """The window ending after step `step`: this rank's measured fields of its `agreement.WindowReport`
        (images_per_sec, data_wait_frac, step_time_ms, gpu_util_pct). The one place a hook may sync."""
        return {}

    def on_window(self, step: int, agreed: Agreement) -> None:
        """The window ending after step `step`, with what every rank agreed on (log it here)."""

    def on_epoch_end(self, step: int) -> None:
        """The epoch ended after step `step` (its last, partial window already ended)."""

    def on_eval(self, values: dict[str, float], step: int) -> None:
        """Validation's figures after step `step` (`val/acc`, ..., `data/skipped_samples`)."""

    def failure_notes(self) -> str:
        """A sentence for a message that ends the run (the metrics: the memory peaks), or ''."""
        return ""

    def summary(self, end: RunEnd) -> dict[str, Any]:
        """This instrument's fields of the run's summary (every rank calls it: it may exchange)."""
        return {}

    def on_summary(self, summary: dict[str, Any], path: Path) -> None:
        """The whole summary: publish it (the metrics: metrics.json at `path`, on rank 0)."""


HOOKS = tuple(name for name in vars(Instrument) if not name.startswith("_"))


class Instruments:
    """The run's instruments, each hook fanned out to those that define it, in list order. The per-step hooks
    are bound once here, so a step costs one call per instrument that has the hook and nothing for the rest."""

    def __init__(self, instruments: Sequence[Any] = ()) -> None:
        self.items = list(instruments)
        self._hooks = {name: [getattr(item, name) for item in self.items if _defines(item, name)] for name in HOOKS}
        self._step_hooks = self._hooks["on_step_end"]
        self._batch_hooks = self._hooks["on_batch"]
        marks = self._hooks["range"]
        # the step's labels: the one instrument that marks (the profiler), or nothing; several nest
        self.range: Mark = marks[0] if len(marks) == 1 else self._nested if marks else no_range

    def _call(self, name: str, *args: Any) -> list[Any]:
        return [hook(*args) for hook in self._hooks[name]]

    @contextlib.contextmanager
    def running(self, start_step: int, total_steps: int, lr: Callable[[], float]) -> Iterator[Instruments]:
        """`on_run_start` on each, then `on_run_end` on each that started, last first, however training ends."""
        with contextlib.ExitStack() as stack:
            for item in self.items:
                if _defines(item, "on_run_start"):
                    item.on_run_start(start_step, total_steps, lr)
                if _defines(item, "on_run_end"):
                    stack.callback(item.on_run_end)
            yield self

    def on_epoch_start(self, epoch: int, steps: int) -> None:
        self._call("on_epoch_start", epoch, steps)

    def on_batch(self, wait: float, transfer: float, times: tuple) -> None:
        for hook in self._batch_hooks:
            hook(wait, transfer, times)

    def on_step_end(self, step: int, loss: torch.Tensor, logits: torch.Tensor, labels: torch.Tensor) -> None:
        for hook in self._step_hooks:
            hook(step, loss, logits, labels)

    def window_ends(self) -> tuple[int, ...]:
        return tuple(step for ends in self._call("window_ends") for step in ends)

    def window_report(self, step: int) -> dict[str, float]:
        fields: dict[str, float] = {}
        for part in self._call("window_report", step):
            fields.update(part)
        return fields

    def on_window(self, step: int, agreed: Agreement) -> None:
        self._call("on_window", step, agreed)

    def on_epoch_end(self, step: int) -> None:
        self._call("on_epoch_end", step)

    def on_eval(self, values: dict[str, float], step: int) -> None:
        self._call("on_eval", values, step)

    def failure_notes(self) -> str:
        return " ".join(note for note in self._call("failure_notes") if note)

    def finish(self, end: RunEnd, path: Path) -> dict[str, Any]:
        """The run's summary: each instrument's fields (a field one left None, a later one may fill), then the
        figures the run itself knows (steps, validation) where none gave them; published by `on_summary`."""
        summary: dict[str, Any] = {}
        for part in self._call("summary", end):
            for key, value in part.items():
                if summary.get(key) is None:
                    summary[key] = value
        for key, value in trained(end.progress).items():
            summary.setdefault(key, value)
        self._call("on_summary", summary, path)
        return summary

    def _nested(self, name: str) -> contextlib.AbstractContextManager:
        stack = contextlib.ExitStack()
        for mark in self._hooks["range"]:
            stack.enter_context(mark(name))
        return stack


def _defines(item: Any, hook: str) -> bool:
    """Whether `item` has `hook` of its own (not `Instrument`'s no-op): only those are called."""
    return hasattr(item, hook) and getattr(type(item), hook, None) is not vars(Instrument)[hook]


def trained(progress: Progress) -> dict[str, Any]:
    """What a run reports with no instrument: its steps and validation figures (what a sweep optimises)."""
    best = {"best_val_acc": progress.best_val_acc, "best_val_acc_ema": progress.best_val_acc_ema}
    return {"steps": progress.step, **{key: progress.val.get(key) for key in summary_fields()}, **best}
