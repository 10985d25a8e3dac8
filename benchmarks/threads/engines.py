"""The three loaders measure.py compares, over the same work: the project's training Dataset wrapped as
pipeline.build_loader wraps it (GuardedSamples: a batch's samples read and decoded, each seeded by its (seed, epoch,
index) from EpochSampler), then the project's `collate` (the batched crop and flip, the policy, the Batch).

- dataloader: the DataLoader pipeline.build_loader builds (N worker processes, persistent, prefetch_factor 2);
- torchdata: torchdata.nodes 0.11, SamplerWrapper -> ParallelMapper(method="thread", N threads, in order) -> Loader;
- spdl: spdl.pipeline 0.8, a continuous source -> pipe(concurrency=N, output_order="input") on N threads -> sink.

In the two thread engines one call of the map function is one whole batch, as one call of a DataLoader worker
is: `collate(samples.__getitems__(indices))`. torchdata and spdl are imported by name (importlib): the project's
venv has neither, and tests/test_gpu_suite.py resolves every import a benchmark names.
"""

from __future__ import annotations

import importlib
import threading
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.utils.data import BatchSampler

from imgtrain.config.data import DataConfig
from imgtrain.data.failures import stop_workers
from imgtrain.data.loader import LoaderPlan, plan_loader, train_sampler
from imgtrain.data.pipeline import build_loader
from imgtrain.data.samplers import EpochSampler
from imgtrain.data.samples import Batch, GuardedSamples, collate

ENGINES = ("dataloader", "torchdata", "spdl")
MODULES = {"dataloader": "torch.utils.data", "torchdata": "torchdata.nodes", "spdl": "spdl.pipeline"}
SEED = 0  # train.seed
_thread = threading.local()


def engine_module(engine: str) -> Any:
    """The engine's package, imported by name (once per process; child.py times it apart from the loader)."""
    return importlib.import_module(MODULES[engine])


def plan_of(batch: int, workers: int) -> LoaderPlan:
    """The training plan train.py would make on a CPU for data.batch_size=`batch`, data.num_workers=`workers` and
    the other data.* defaults (persistent workers, prefetch_factor 2, drop_last, shuffle, stage timings)."""
    return plan_loader(DataConfig(batch_size=batch, num_workers=workers), train=True, device_type="cpu")


def one_torch_thread() -> None:
    """In a loader thread, once: torch's intra-op threads for this thread's kernels set to 1, as a DataLoader worker
    process sets them (torch/utils/data/_utils/worker.py). The setting is per thread (OpenMP's nthreads-var): a
    thread that did not call it would run its kernels on every core, and N of them would oversubscribe the 2
    cores N-fold. torchdata's _apply_udf does the same; spdl's thread pool does not."""
    if not getattr(_thread, "single", False):
        torch.set_num_threads(1)
        _thread.single = True


class Loader:
    """One engine's loader: `epoch(e)` is that epoch's iterator of Batches; `close()` stops its workers."""

    name = ""

    def __init__(self, dataset: Any, plan: LoaderPlan) -> None:
        self.plan = plan
        self.batch, self.workers = plan.kwargs["batch_size"], plan.kwargs["num_workers"]
        self.sampler: EpochSampler = train_sampler(len(dataset), plan, seed=SEED, rank=0, world_size=1)
        self.samples = GuardedSamples(dataset, replace=True, timed=plan.stage_timings, augment_on=plan.augment_on)

    def batches(self) -> BatchSampler:
        """Each batch's (index, seed) pairs in the sampler's current epoch, as the DataLoader groups them."""
        return BatchSampler(self.sampler, self.batch, drop_last=self.plan.kwargs["drop_last"])

    def make_batch(self, items: list[tuple[int, int]]) -> Batch:
        """What a DataLoader worker does for one batch: its samples, then collate (in a loader thread here)."""
        one_torch_thread()
        return collate(self.samples.__getitems__(items))

    def epoch(self, epoch: int) -> Iterator[Batch]:
        raise NotImplementedError

    def close(self) -> None:
        pass

    def bounds(self) -> str:
        """How many batches may be computed or waiting at once (the memory a loader holds ahead)."""
        raise NotImplementedError


class ProcessLoader(Loader):
    """The project's own DataLoader (pipeline.build_loader), N worker processes."""

    name = "dataloader"

    def __init__(self, dataset: Any, plan: LoaderPlan) -> None:
        super().__init__(dataset, plan)
        self.loader = build_loader(dataset, plan, train=True, seed=SEED)
        self.sampler = self.loader.sampler  # the one the DataLoader iterates (set_epoch as RunData.start_epoch)

    def epoch(self, epoch: int) -> Iterator[Batch]:
        self.sampler.set_epoch(epoch)
        return iter(self.loader)

    def close(self) -> None:
        stop_workers(getattr(self.loader, "_iterator", None))

    def bounds(self) -> str:
        return f"{self.plan.kwargs['prefetch_factor'] * self.workers} batches (prefetch_factor x workers)"


class NodesLoader(Loader):
    """torchdata.nodes: the epoch's batches of indices -> ParallelMapper on N threads, in order -> Loader. Each
    `iter()` resets the graph: ParallelMapper starts N new threads (and a reader and a sorter) every epoch."""

    name = "torchdata"

    def __init__(self, dataset: Any, plan: LoaderPlan) -> None:
        super().__init__(dataset, plan)
        nodes = engine_module(self.name)
        # max_concurrent left at its default, 2 x num_workers: the DataLoader's prefetch_factor 2 (0.11.0 refuses a
        # value above num_workers, map.py:320-322)
        mapped = nodes.ParallelMapper(
            nodes.SamplerWrapper(self.batches()), self.make_batch, num_workers=self.workers, method="thread"
        )
        self.loader = nodes.Loader(mapped)

    def epoch(self, epoch: int) -> Iterator[Batch]:
        self.sampler.set_epoch(epoch)  # BatchSampler has no set_epoch: SamplerWrapper's own counter stays unused
        return iter(self.loader)

    def bounds(self) -> str:
        return f"{2 * self.workers} batches (max_concurrent's default, 2 x num_workers)"


class EpochSource:
    """spdl's continuous source: each `iter()` (the source thread's, right after the previous epoch's last batch
    left it) is the next epoch's batches, so the next epoch is prepared while the consumer finishes this one."""

    def __init__(self, loader: Loader, first: int = 0) -> None:
        self.loader, self.next_epoch = loader, first

    def __iter__(self) -> Iterator[list[tuple[int, int]]]:
        self.loader.sampler.set_epoch(self.next_epoch)
        self.next_epoch += 1
        return iter(list(self.loader.batches()))  # the order drawn now, before the sampler moves on


class SpdlLoader(Loader):
    """spdl.pipeline: one pipeline for the whole run (a continuous source), the batch function on a thread pool
    of N, in input order; `get_iterator()` is one epoch. max_failures=0: the first exception ends the pipeline
    (the default, -1, logs it and drops the batch)."""

    name = "spdl"
    SINK = 1  # batches the sink holds beyond the stage's own queues (spdl's default is 3)

    def __init__(self, dataset: Any, plan: LoaderPlan) -> None:
        super().__init__(dataset, plan)
        spdl = engine_module(self.name)
        builder = spdl.PipelineBuilder().add_source(EpochSource(self), continuous=True)
        builder.pipe(self.make_batch, concurrency=self.workers, output_order="input", name="batch")
        self.pipeline = builder.add_sink(self.SINK).build(num_threads=self.workers, max_failures=0)

    def epoch(self, epoch: int) -> Iterator[Batch]:
        return self.pipeline.get_iterator()

    def close(self) -> None:
        self.pipeline.stop(timeout=10)

    def bounds(self) -> str:
        # the ordered stage: `concurrency` tasks queued in order plus one being put and one awaited (module
        # spdl.pipeline._components._pipe, _ordered_pipe), its output queue (2: _BUFFER_SIZE of
        # spdl.pipeline._components._node), the sink
        return f"about {self.workers + 2 + 2 + self.SINK} batches (ordered stage N+2, its queue 2, sink {self.SINK})"


BUILDERS: dict[str, Callable[[Any, LoaderPlan], Loader]] = {
    "dataloader": ProcessLoader,
    "torchdata": NodesLoader,
    "spdl": SpdlLoader,
}


def build(engine: str, dataset: Any, plan: LoaderPlan) -> Loader:
    return BUILDERS[engine](dataset, plan)
