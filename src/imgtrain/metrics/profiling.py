"""`metrics.profile=true`: a torch.profiler trace of a few steady-state steps, opened in Perfetto.

The schedule waits `metrics.skip_first_steps` steps (start-up is not the steady state), warms the profiler up for
one step, then records `metrics.profile_steps` steps. The loop marks labelled ranges (`RANGES`, as
`imgtrain/<name>`) through `Profiler.range`; with profiling off, or once the trace is written, that is a
shared no-op context: a `record_function` costs 13-22 us even with no profiler running (2-core VM), five
of them per step. Only rank 0 profiles: every rank runs the same step, and one trace shows its shape.
`Profiler` is an instrument of the loop (the hooks of `train/instruments.py`'s `Instrument`, by name).
"""

from __future__ import annotations

import contextlib
import logging
import os
import tempfile
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

import torch
from torch.profiler import ProfilerActivity, record_function

from imgtrain.common.atomic import atomic_write
from imgtrain.common.errors import RunError
from imgtrain.common.links import refuse_foreign_links
from imgtrain.config.metrics import MetricsConfig
from imgtrain.host import dist

log = logging.getLogger(__name__)

PREFIX = "imgtrain/"
RANGES = ("data_wait", "h2d", "forward", "backward", "optimizer")  # the loop's labelled ranges, in step order
PROFILER_WARMUP = 1  # steps the profiler runs unrecorded first: its own start-up would skew the first one
TOP_OPERATORS = 10  # rows of the operator table
_NOTHING = contextlib.nullcontext()  # stateless, so one instance serves every range


def no_range(name: str) -> AbstractContextManager:
    """A range that marks nothing (validation, other ranks, profiling off)."""
    return _NOTHING


class Profiler:
    """A context manager around `torch.profiler.profile`, stepped once per training step by the loop.

    Writes `<out_dir>/profile/trace_rank<r>.json.gz` (Chrome/Perfetto JSON, gzipped) and the top-operator
    table next to it as `top_ops_rank<r>.txt`; `trace` is the trace's path once written, else None.
    """

    def __init__(
        self, measure: MetricsConfig, device: torch.device, info: dist.DistInfo, out_dir: Path, steps_left: int
    ) -> None:
        self.wait, self.active = measure.skip_first_steps, measure.profile_steps
        self.needed = self.wait + PROFILER_WARMUP + self.active  # steps from this process's start to the trace
        self.enabled = measure.profile and info.is_main
        if self.enabled and steps_left < self.needed:
            log.warning(
                "metrics.profile=true needs %d steps (metrics.skip_first_steps=%d, %d profiler warm-up, "
                "metrics.profile_steps=%d) but this run has %d to go: no trace is written",
                *(self.needed, self.wait, PROFILER_WARMUP, self.active, steps_left),
            )
            self.enabled = False
        # The traced steps run slower (every op recorded, then the trace written): every rank leaves them out of
        # its throughput, since under DDP rank 0's profiling holds the others back too. Decided from the settings
        # alone, so the ranks agree.
        will_trace = measure.profile and steps_left >= self.needed
        self.profiled_steps = PROFILER_WARMUP + self.active if will_trace else 0
        if will_trace:
            log.info(
                "metrics.profile=true: steps %d-%d are profiled and left out of images/s and data wait",
                *(self.wait + 1, self.needed),
            )
        self.cuda = device.type == "cuda"
        self.folder = out_dir / "profile"
        if self.enabled:  # profile/ a link another user planted: refused before training, in one line
            refuse_foreign_links(out_dir, self.folder.name)
        self.path = self.folder / f"trace_rank{info.rank}.json.gz"
        self.table_path = self.folder / f"top_ops_rank{info.rank}.txt"
        self.trace: str | None = None
        self.steps = 0  # steps of this process so far
        self.marking = self.enabled  # whether `range` records: until the trace is written
        self._profile: Any = None
        self._stack = contextlib.ExitStack()

    def range(self, name: str) -> AbstractContextManager:
        """The labelled range `imgtrain/<name>` while a trace may be recorded; otherwise a no-op context."""
        return record_function(PREFIX + name) if self.marking else _NOTHING

    def __enter__(self) -> Profiler:
        if self.enabled:
            if not self.cuda:  # a CUDA build's profiler, with no GPU, logs "ERROR: gpuGetDeviceCount failed"
                os.environ.setdefault("KINETO_LOG_LEVEL", "5")  # read when the profiler first starts
            activities = [ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if self.cuda else [])]
            schedule = torch.profiler.schedule(wait=self.wait, warmup=PROFILER_WARMUP, active=self.active, repeat=1)
            profile = torch.profiler.profile(
                activities=activities,
                schedule=schedule,
                on_trace_ready=self._save,
                record_shapes=False,  # shapes cost time per op; the operator table is by name
                profile_memory=False,
            )
            self._profile = self._stack.enter_context(profile)
        return self

    def on_run_start(self, *start: Any) -> None:
        self.__enter__()

    def on_run_end(self) -> None:
        self.__exit__(None, None, None)

    def on_step_end(self, *step_end: Any) -> None:
        """End one training step (`on_step_end(step, loss, logits, labels)`, whose arguments it needs not, or
        `step()`); the trace is written after the last active one."""
        if self._profile is None:
            return
        self.steps += 1
        self._profile.step()
        if self.steps >= self.needed:  # the trace is written (or failed to be): stop the profiler now
            self._close()

    step = on_step_end  # one function, two names: the loop's hook costs no extra call per step

    def summary(self, end: Any) -> dict[str, Any]:
        """The summary's `profile_trace`: rank 0's trace, if written."""
        return {"profile_trace": self.trace}

    def __exit__(self, *exc: Any) -> None:
        self._close()
        if self.enabled and self.steps < self.needed:
            log.warning("profiler: the run stopped after %d of %d steps: no trace written", self.steps, self.needed)

    def _close(self) -> None:
        self.marking, self._profile = False, None
        self._stack.close()

    def _write(self, profile: torch.profiler.profile, table: str) -> None:
        """The trace and the table, each written whole under a name no one else can take, then renamed over its
        name in profile/: a link planted there (a run directory others may write to) is replaced, not followed."""
        refuse_foreign_links(self.folder.parent, self.folder.name)
        self.folder.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(prefix=".trace.", dir=self.folder) as private:  # 0700, a random name
            staged = Path(private) / self.path.name
            profile.export_chrome_trace(str(staged))  # gzipped: the name ends in .gz
            os.replace(staged, self.path)
        atomic_write(self.table_path, lambda f: f.write(f"{table}\n".encode()))

    def _save(self, profile: torch.profiler.profile) -> None:
        """on_trace_ready: write the trace and the operator table, unless the run stopped before the last step."""
        if self.steps < self.needed:
            return
        sort_by = "self_cuda_time_total" if self.cuda else "self_cpu_time_total"
        table = profile.key_averages().table(sort_by=sort_by, row_limit=TOP_OPERATORS)
        try:
            self._write(profile, table)
        except (OSError, RunError) as error:  # a full disk (or a link planted since) costs the trace, not the run
            log.warning("profiler: could not write %s: %s", self.folder, error)
            return
        self.trace = str(self.path)
        first = self.wait + PROFILER_WARMUP + 1
        log.info(
            "profiler: steps %d-%d of this process written to %s; open it at https://ui.perfetto.dev "
            "(or chrome://tracing)",
            *(first, first + self.active - 1, self.path),
        )
        log.info("profiler: top %d operators by %s (also in %s):\n%s", TOP_OPERATORS, sort_by, self.table_path, table)
