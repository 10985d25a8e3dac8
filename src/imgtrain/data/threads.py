"""data.engine=threads: the training batches made by loader threads in the training process, through torchdata.nodes
(0.11: chosen by measurement and by its code, docs/engine-evaluation/threads.md), instead of worker processes.

The unit of work is the DataLoader worker's: one batch, `collate(GuardedSamples.__getitems__(items))`, its
(index, seed) pairs from the same EpochSampler. So the same samples come in the same order with the same draws
(each sample's from its own seed: data/policies.py), the same guard replaces unreadable files, the same stage
timings travel with each batch, and DDP sharding and a mid-epoch resume stay the sampler's. Threads need no
process start, no pickling and no /dev/shm, and share the process's memory; they share its GIL too, so Python-level
per-sample work does not scale with them (the verdict says so).

torchdata.nodes is an optional engine (`pip install -e '.[threads]'`), imported when a run chooses threads. One
graph from epoch to epoch: IterableWrapper over the batches of (index, seed) of this epoch, then of the next ones
(`_epochs`, an end-of-epoch marker between them) -> ParallelMapper(method="thread", in order, at most 2 x threads
batches in flight: the DataLoader's prefetch_factor 2) -> PinMemory on CUDA. So the next epoch's first batches are
made while this one ends and validation runs: torchdata rebuilds its threads at every `iter()` (0.12-0.26 s of
epoch-start stall on the 2-core machine, docs/engine-evaluation/threads.md). An epoch that is not the one made
ahead (a resume part-way, a new sampler state) starts a new graph, and so does every epoch with
data.in_order=false, where a marker could overtake its epoch's batches. A pump thread hands each batch over
through a queue, so that data.timeout can end the wait: torchdata has no timeout, and a thread stuck in a read
cannot be stopped. Every thread is a daemon, so a stuck one is abandoned, named in the one line, and the process
still exits.
"""

from __future__ import annotations

import copy
import logging
import queue
import threading
import time
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils.data import BatchSampler

from imgtrain.data import reads
from imgtrain.data.failures import LoaderFailed
from imgtrain.data.samples import Batch, GuardedSamples, collate
from imgtrain.host import optional

log = logging.getLogger(__name__)
NEEDED_BY = "data.engine=threads"
_END = object()  # the pump's last item: the source is exhausted
_EPOCH_END = object()  # between one epoch's batches and the next's
JOIN_S = 10  # seconds `close` waits for the threads to finish the batch in hand (one batch takes far less)


# Handles that loader threads must not share, by the module of their type: a sqlite3 connection refuses other
# threads (check_same_thread), h5py serialises every call behind one lock, an LMDB transaction belongs to its thread.
UNSAFE_HANDLES = ("sqlite3", "h5py", "lmdb")


def shared_handles(dataset: Any, depth: int = 3) -> list[str]:
    """`attribute (type)` for each handle of UNSAFE_HANDLES a dataset (or the dataset it wraps) holds."""
    found = []
    for name, value in vars(dataset).items() if hasattr(dataset, "__dict__") else ():
        module = type(value).__module__.partition(".")[0]
        if module in UNSAFE_HANDLES:
            found.append(f"{type(dataset).__name__}.{name} ({type(value).__module__}.{type(value).__name__})")
        elif name == "dataset" and depth > 1:
            found += shared_handles(value, depth - 1)
    return found


class _Failed:
    """An exception raised while making a batch, carried to the training thread."""

    def __init__(self, error: BaseException) -> None:
        self.error = error


class ThreadLoader:
    """The training split's loader on `threads` loader threads: iterate it once per epoch, as a DataLoader."""

    def __init__(self, samples: GuardedSamples, sampler: Any, *, batch_size: int, drop_last: bool, threads: int,
                 in_order: bool = True, pin_memory: bool = False, timeout: float = 0.0) -> None:  # fmt: skip
        self.nodes = optional.require("torchdata.nodes", NEEDED_BY)
        self.samples, self.sampler, self.batch_size, self.drop_last = samples, sampler, batch_size, drop_last
        self.num_workers, self.in_order, self.pin_memory, self.timeout = threads, in_order, pin_memory, timeout
        # each loader thread's batch in the making, and since when (time.monotonic()): what a timeout names
        self._busy: dict[int, tuple[float, list[Any]]] = {}
        self._local = threading.local()
        # the thread handing over the batches, and the (epoch, start) it makes next; None: none running
        self._running: _Pump | None = None
        self._stuck = False  # a wait ran past data.timeout: its threads are left behind, not waited for
        shared = shared_handles(samples.dataset)
        if shared:  # opened once in __init__, then used by every loader thread
            log.warning(
                "data.engine=threads: the dataset holds %s, which the %d loader threads would share; such handles "
                "are not thread-safe: open one per thread (threading.local) or use data.engine=dataloader",
                ", ".join(shared),
                threads,
            )

    def __len__(self) -> int:
        return len(BatchSampler(self.sampler, self.batch_size, self.drop_last))

    def _make_batch(self, items: Any) -> Any:
        """One batch, in a loader thread, as a DataLoader worker makes it (an epoch's end passes through)."""
        if items is _EPOCH_END:
            return items
        if not getattr(self._local, "ready", False):
            torch.set_num_threads(1)  # per thread (OpenMP's setting): N threads, N cores, as N worker processes
            self._local.ready = True
        self._busy[threading.get_ident()] = (time.monotonic(), items)
        started = time.thread_time()
        try:
            batch = collate(self.samples.__getitems__(items))
        finally:
            self._busy.pop(threading.get_ident(), None)
        if not batch.times:  # data.stage_timings=false
            return batch
        return batch._replace(times=batch.times._replace(cpu=time.thread_time() - started))

    def _epochs(self, epoch: int, start: int) -> Iterator[Any]:
        """The batches of (index, seed) of epoch `epoch` from sample `start`, each epoch followed by _EPOCH_END;
        in order, then those of every later epoch from its start (so the next epoch is made while this one ends);
        out of order (data.in_order=false) that epoch alone, since its end could overtake its batches. Its own copy
        of the sampler: the training thread's is set for the epoch it reads, not the one made ahead."""
        sampler = copy.copy(self.sampler)
        while True:
            sampler.set_epoch(epoch, start)
            yield from BatchSampler(sampler, self.batch_size, self.drop_last)
            yield _EPOCH_END
            if not self.in_order:
                return
            epoch, start = epoch + 1, 0

    def _graph(self, epoch: int, start: int) -> Any:
        """torchdata's graph from (epoch, start) on: the batches, each made by one of the threads."""
        nodes = self.nodes
        node = nodes.ParallelMapper(
            nodes.IterableWrapper(self._epochs(epoch, start)), self._make_batch, num_workers=self.num_workers,
            in_order=self.in_order, method="thread",
        )  # fmt: skip
        return nodes.PinMemory(node) if self.pin_memory else node

    def __iter__(self) -> Iterator[Batch]:
        epoch = (self.sampler.epoch, self.sampler.start)
        if self._running is None or self._running.epoch != epoch:  # not the epoch made ahead: a resume, a new loader
            self.close()
            self._running = _Pump(self._graph(*epoch), epoch)
        running = self._running
        finished = False
        try:
            while True:
                item = self._next(running.handed)
                if item is _EPOCH_END or item is _END:
                    finished = True
                    running.epoch = (epoch[0] + 1, 0)  # what the pipeline makes next
                    return
                if isinstance(item, _Failed):
                    raise item.error
                yield item
        finally:  # an epoch left part-way (a probe, a stop, an error), or out of order: its threads end
            if not finished or not self.in_order:
                self.close()

    def _next(self, handed: queue.Queue) -> Any:
        try:
            return handed.get(timeout=self.timeout or None)
        except queue.Empty:
            self._stuck = True
            stuck = self._stuck_in()
            where = f"; stuck in: {stuck}" if stuck else ""
            raise LoaderFailed(
                f"data.timeout={self.timeout:g}: no batch from the {self.num_workers} loader thread(s) in "
                f"{self.timeout:g} s{where} (a thread stuck in a read cannot be stopped: it is left behind, and the "
                "process exits without it); check the storage, or raise data.timeout"
            ) from None

    def _stuck_in(self) -> str | None:
        """What the thread busy longest is in: the file it is reading (data/reads.py), else the batch it makes;
        None when no thread is busy."""
        busy = dict(self._busy)  # one copy, under the GIL: the threads add and remove their entries meanwhile
        if not busy:
            return None
        thread, (_, items) = min(busy.items(), key=lambda entry: entry[1][0])
        return reads.in_read(thread) or self._describe(items)

    def _describe(self, items: list[Any]) -> str:
        """The batch a stuck thread was making: its files where the dataset names them, else its indices."""
        indices = [item[0] if isinstance(item, tuple) else item for item in items]
        path = getattr(self.samples.dataset, "path", None)
        if callable(path):
            return ", ".join(str(path(index)) for index in indices[:3]) + (" ..." if len(indices) > 3 else "")
        return f"samples {indices[:8]}"

    def close(self) -> None:
        """Stop making batches, and wait (at most JOIN_S) for the threads to finish the batch in hand: a thread
        left inside torch's or a decoder's code when the interpreter exits aborts the process. One stuck in a read
        is left behind (they are daemons), and said; after data.timeout has named it, it is not waited for."""
        running, self._running = self._running, None
        if running is None:
            return
        if self._stuck:
            running.stop.set()
            return
        deadline = time.monotonic() + JOIN_S
        running.stop_and_join(JOIN_S)
        while self._busy and time.monotonic() < deadline:  # torchdata's threads finishing the batch in hand
            time.sleep(0.01)
        stuck = self._stuck_in()
        if stuck:
            log.warning("data.engine=threads: a loader thread is still in %s after %d s: left behind", stuck, JOIN_S)


class _Pump:
    """The thread that iterates a graph and hands each batch over (`handed`): the graph is its alone, so when it
    returns the graph goes, and torchdata stops and joins the graph's threads (ParallelMapper's iterator does so
    when it is collected)."""

    def __init__(self, graph: Any, epoch: tuple[int, int]) -> None:
        self.epoch = epoch  # the (epoch, start) whose batches come next
        self.stop, self.handed = threading.Event(), queue.Queue(maxsize=1)
        self.thread = threading.Thread(target=_pump, args=(graph, self.handed, self.stop), daemon=True)
        self.thread.start()

    def stop_and_join(self, seconds: float) -> None:
        """Stop it, and wait up to `seconds` for it to end (its graph's threads told to stop as it ends)."""
        self.stop.set()
        self.thread.join(timeout=seconds)


def _pump(graph: Any, handed: queue.Queue, stop: threading.Event) -> None:
    """Iterate the epoch's graph and hand each batch over; then _END, or the error that ended it. The graph is
    this thread's alone: when the pump returns, it goes, and its threads with it."""
    try:
        graph.reset()
        while not stop.is_set():
            try:
                item: Any = next(graph)
            except StopIteration:
                item = _END
            except Exception as error:  # carried to the training thread, which raises it
                item = _Failed(error)
            while not stop.is_set():  # the training thread may have left the epoch: then stop waiting
                try:
                    handed.put(item, timeout=0.1)
                    break
                except queue.Full:
                    continue
            if item is _END or isinstance(item, _Failed):
                return
    finally:
        del graph
