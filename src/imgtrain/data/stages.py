"""Where input time goes, stage by stage: clocks that travel with each sample and each batch.

In a worker (or the training process with num_workers=0), a Dataset records each sample's read, decode and
augment seconds (`record`); `GuardedSamples` takes them (`take`) with the sample's total, and `collate` sums a
batch's samples into one `BatchTimes`, stamped with the moment the batch was finished. The training process
then splits its data wait in two: waiting for a worker still computing, and `transfer`, the time from a
finished batch to the loop holding it (queue, unpickling, pinning). `StreamTimer`s time the host-to-device copy
and, with dataset.decode=cuda, the decode stream's span per batch (there a batch is finished when the decode thread
hands it over, so `transfer` is not the decode's time), with CUDA events read at the logging window
(never a sync of their own). That span is wall time on the stream, not GPU work: nvJPEG blocks the decode thread
until the batch is decoded, and the stream waits for it in between.

Cost: 6.9 us per image on the 2-core development machine (BENCHMARKS.md, `bench.py --only breakdown`), about
1% of loading a 32-px JPEG; `data.stage_timings=false` turns the batch and copy clocks off.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import NamedTuple

import torch

WORKER_STAGES = ("read", "decode", "augment", "collate")  # timed in the workers (wall clock)
LOOP_STAGES = ("transfer", "h2d", "gpu_decode")  # time in the training process
STAGES = (*WORKER_STAGES, *LOOP_STAGES)

_sample = threading.local()  # the current sample's stage seconds, in the process (and thread) that loads it


def record(read: float = 0.0, decode: float = 0.0, augment: float = 0.0) -> None:
    """Called by a Dataset's __getitem__: this sample's seconds per stage (a Dataset that never calls it has its
    whole __getitem__ counted as decode)."""
    _sample.times = (read, decode, augment)


def take() -> tuple[float, float, float] | None:
    """The stage seconds the last sample recorded, once (None when its Dataset recorded none)."""
    times = getattr(_sample, "times", None)
    _sample.times = None
    return times


class BatchTimes(NamedTuple):
    """One batch's input-pipeline seconds, summed over its samples, and when it was finished."""

    read: float = 0.0
    decode: float = 0.0
    augment: float = 0.0
    collate: float = 0.0
    busy: float = 0.0  # every second the worker spent on this batch: its samples' __getitem__ and collate
    finished: float = 0.0  # time.perf_counter() when collate ended (CLOCK_MONOTONIC: the same in every process)
    samples: int = 0  # samples loaded for it (unreadable ones replaced included)
    # CPU seconds the loader thread ran while making it (data.engine=threads: time.thread_time); 0: not measured.
    # Below `busy`, the thread waited: for the GIL, for a core, or for a read
    cpu: float = 0.0


def timed_sample(load, *args) -> tuple[object, tuple[float, float, float, float]]:
    """Call `load(*args)` and return (its result, (read, decode, augment, total) seconds)."""
    take()  # a sample that failed part-way must not leave its times to the next one
    started = time.perf_counter()
    result = load(*args)
    total = time.perf_counter() - started
    parts = take()
    read, decode, augment = parts if parts is not None else (0.0, total, 0.0)
    return result, (read, decode, augment, total)


def batch_times(samples: list[tuple[float, float, float, float]], collate_started: float) -> BatchTimes:
    """Sum the samples' stage seconds into one BatchTimes; collate ends now."""
    finished = time.perf_counter()
    collate = finished - collate_started
    read, decode, augment, total = (sum(column) for column in zip(*samples, strict=True)) if samples else (0.0,) * 4
    return BatchTimes(read, decode, augment, collate, total + collate, finished, samples=len(samples))


def transfer_seconds(times: BatchTimes | tuple, wait_started: float, received: float) -> float:
    """The part of a data wait spent after the batch was finished: from max(finished, wait start) to receipt."""
    if not times or not times.finished:
        return 0.0
    return max(0.0, received - max(times.finished, wait_started))


class StreamTimer:
    """GPU work's duration: CUDA events around what is queued on a stream, read after the next sync (the logging
    window's). Spans may be recorded in another thread (the GPU decode thread) and collected in the loop's.

    On a CPU device there is nothing to time: the timer is off, and the figure is n/a, not 0.
    """

    def __init__(self, device: torch.device, enabled: bool) -> None:
        self.enabled = enabled and device.type == "cuda"
        self.pending: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
        self._lock = threading.Lock()  # the decode thread appends while the loop collects

    @contextmanager
    def span(self, stream: torch.cuda.Stream | None = None) -> Iterator[None]:
        """Time what is queued inside on `stream` (the current one by default), without waiting for it."""
        if not self.enabled:
            yield
            return
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record(stream)
        yield
        end.record(stream)
        with self._lock:
            self.pending.append((start, end))

    def collect(self) -> tuple[float, int] | None:
        """(seconds, spans) of the spans whose events completed (all of them right after a sync); None on CPU."""
        if not self.enabled:
            return None
        with self._lock:
            pending = self.pending
            finished = [end.query() for _, end in pending]
            self.pending = [pair for pair, ok in zip(pending, finished, strict=True) if not ok]
        done = [pair for pair, ok in zip(pending, finished, strict=True) if ok]
        return sum(start.elapsed_time(end) for start, end in done) / 1000.0, len(done)
