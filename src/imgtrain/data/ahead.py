"""Batches made ready for the model in a background thread, on a CUDA stream of its own, ahead of the loop.

The CUDA prefetch (data.prefetch_to_device: the host-to-device copy) and dataset.decode=cuda (nvJPEG and the
crops) both run here. The thread takes batch n+1 from the loader while the loop trains on batch n, so the time the
loop blocks in `next()` is real starvation, and it is the wait for the very batch `next()` then returns: the stage
breakdown books it to that batch's stages. (A prefetcher that fetched batch n+1 from inside the loop's `next()`
for batch n made the loop wait for n+1 to hand out n, which was ready long before, and the breakdown booked a slow
worker's wait as "transfer" of n: on the H200's CPU-decode row, 75% of all waits.)

Nothing here waits for the GPU: the thread records an event after its work, and the loop's stream waits on that
event (`wait_event`), not the host. On a CPU device there are no streams: the same code runs without them (tests).
"""

from __future__ import annotations

import contextlib
import queue
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch

from imgtrain.data.samples import Batch
from imgtrain.data.stages import StreamTimer

AHEAD = 2  # batches made ready before the loop asks: one more than the step in flight, so a late one is absorbed


class BatchesAhead:
    """`prepare(batch)` for each of `batches` in a thread named `name`, on its own CUDA stream, up to `depth`
    batches ahead of the loop (a context manager: leaving stops the thread before the loader is used again).

    `timer` times each `prepare` on that stream (CUDA events, read at the logging window). With `handed_over`,
    a batch counts as finished when the thread hands it over (its `times.finished`): what the loop waits for
    after that is transfer, before it the thread's own work (dataset.decode=cuda, whose GPU stage has its own
    figure); without it the workers' stamp stands, so the thread's copy counts as transfer. `inner` is the
    loader's iterator, for explaining its failures (data/failures.py)."""

    _END = object()

    def __init__(
        self,
        batches: Iterator[Batch],
        prepare: Callable[[Batch], Batch],
        device: torch.device,
        *,
        name: str,
        depth: int = AHEAD,
        timer: StreamTimer | None = None,
        handed_over: bool = False,
    ) -> None:
        self.inner, self.prepare, self.device = batches, prepare, device
        self.timer = timer or StreamTimer(device, enabled=False)
        self.handed_over = handed_over
        self.ready: queue.Queue = queue.Queue(maxsize=depth)
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self._prepare_all, name=name, daemon=True)

    def _prepare_all(self) -> None:
        """The thread: batch after batch; an error is handed to the loop, which raises it."""
        stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        try:
            with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
                for batch in self.inner:
                    if self.stopping.is_set():
                        return
                    with self.timer.span(stream):
                        ready = self.prepare(batch)
                    done = stream.record_event() if stream is not None else None
                    if self.handed_over and ready.times:
                        ready = ready._replace(times=ready.times._replace(finished=time.perf_counter()))
                    self._hand_over((ready, done))
            self._hand_over(self._END)
        except BaseException as error:  # noqa: BLE001 - raised again in the training thread
            self._hand_over(error)

    def _hand_over(self, item: Any) -> None:
        while not self.stopping.is_set():
            try:
                self.ready.put(item, timeout=0.1)
                return
            except queue.Full:
                continue

    def __enter__(self) -> BatchesAhead:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stopping.set()
        while self.thread.is_alive():  # the thread may be waiting for a worker's batch: let it finish
            with contextlib.suppress(queue.Empty):
                self.ready.get(timeout=0.1)

    def __iter__(self) -> BatchesAhead:
        return self

    def __next__(self) -> Batch:
        item = self.ready.get()
        if item is self._END:
            self.ready.put(self._END)  # every later next() ends too
            raise StopIteration
        if isinstance(item, BaseException):
            raise item
        batch, done = item
        if done is not None:
            current = torch.cuda.current_stream(self.device)
            current.wait_event(done)  # the GPU, not this thread, waits for the side stream
            if batch.images is not None:  # None: a validation batch whose images were all unreadable
                batch.images.record_stream(current)  # not reused by the side stream while the model reads it
            batch.labels.record_stream(current)
        return batch


def prefetcher(batches: Iterator[Batch], device: torch.device, timer: StreamTimer | None = None) -> BatchesAhead:
    """data.prefetch_to_device: each batch's images (a tensor or a RawBatch) and labels copied to `device` in the
    thread, from pinned memory (the loader plan makes prefetch depend on pin_memory), so the copy of batch n+1
    overlaps the step on batch n. The workers' stamp stands: the copy counts as transfer."""

    def copy(batch: Batch) -> Batch:
        images = batch.images.to(device, non_blocking=True)
        return batch._replace(images=images, labels=batch.labels.to(device, non_blocking=True))

    return BatchesAhead(batches, copy, device, name="cuda-prefetch", timer=timer)
