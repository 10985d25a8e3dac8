"""The DataLoader of a `dataset=shards` split: LitData's StreamingDataLoader with the run's `data.*` arguments, and
the run's epoch and position handed to LitData through its own resume state.

LitData deals whole chunks to `world_size x num_workers` workers, so which samples share a batch depends on the
topology (ranks, workers, batch size), not only on the seed and the epoch as on the folder path. The topology
an epoch started with is therefore saved with each checkpoint (`state_dict`). Resumed with the same topology,
LitData replays its order exactly (bit-identical training). With another worker count, the epoch is finished
with the count it started with, so it is replayed exactly too, and the next epoch takes the new count. With
another world size or batch size, LitData re-deals the rest of the epoch onto the new grid ("elastic" resume),
which can repeat a few samples (it rounds the position down to a whole global batch) or leave out each
worker's last incomplete batch; the run says so in one line.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from typing import Any

import torch
from litdata import StreamingDataLoader, StreamingDataset

from imgtrain.data.failures import stop_workers
from imgtrain.data.loader import LoaderPlan
from imgtrain.data.samples import collate
from imgtrain.data.streamed import StreamedLoader, opened

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Topology:
    """What LitData's order depends on besides the seed and the epoch."""

    world_size: int
    num_workers: int
    batch_size: int

    @property
    def global_batch(self) -> int:
        return self.world_size * self.batch_size


class StreamBatches:
    """The batches of one pass; `_shutdown_workers` (what `failures.workers_stopped_on_error` calls on an error or a
    stop) closes LitData's generator and stops the workers, persistent ones included (`stop`)."""

    def __init__(self, batches: Any, stop: Callable[[], None]) -> None:
        self.batches, self.stop = batches, stop

    def __iter__(self) -> StreamBatches:
        return self

    def __next__(self) -> Any:
        return next(self.batches)

    def _shutdown_workers(self) -> None:
        self.batches.close()
        self.stop()


class ShardLoader(StreamedLoader):
    """Batches of a ShardSplit (a StreamingDataset) with the effective DataLoader arguments of `plan` (LitData
    shards over the ranks itself: there is no sampler). For training, `start_epoch` positions it; `state_dict` is
    saved in checkpoints. `replan(workers)` gives the plan with another worker count (to finish a resumed epoch
    with its own; without it, as for tune's probes, which never resume, a changed count is re-dealt by LitData)."""

    sampler = None

    def __init__(
        self,
        dataset: StreamingDataset,
        plan: LoaderPlan,
        *,
        train: bool,
        seed: int,
        rank: int,
        world_size: int,
        replan: Callable[[int], LoaderPlan] | None = None,
    ):
        dataset.train, dataset.timed, dataset.seed = train, plan.stage_timings, seed  # before the workers start
        dataset.augment_on = plan.augment_on
        self.dataset, self.seed, self.rank, self.replicas, self.replan = dataset, seed, rank, world_size, replan
        self.topology = Topology(world_size, plan.kwargs["num_workers"], plan.kwargs["batch_size"])
        self.workers = self.topology.num_workers  # of the loader below
        self.loader = self._loader(plan)
        self.epoch: dict[str, int] | None = None  # the epoch in progress and the topology it started with
        self.skip = 0  # batches of this epoch already trained on (a resumed epoch)
        opened(self)  # streamed.close_all stops its workers at the end of the run

    def _loader(self, plan: LoaderPlan) -> StreamingDataLoader:
        kwargs = dict(plan.kwargs)
        shuffle, drop_last = kwargs.pop("shuffle"), kwargs.pop("drop_last")
        self.workers = kwargs["num_workers"]
        return StreamingDataLoader(
            self.dataset,
            shuffle=shuffle,
            drop_last=drop_last,
            collate_fn=collate,
            generator=torch.Generator().manual_seed(self.seed + self.rank),  # the workers' Python and NumPy seeds
            **kwargs,
        )

    def _use_workers(self, workers: int) -> None:
        """Replace the loader with one of `workers` workers, stopping the old one's persistent workers."""
        if workers != self.workers:
            self.close()
            self.loader = self._loader(self.replan(workers))

    def close(self) -> None:
        """Stop the persistent workers now. LitData's loader and its iterator reference each other, so when the
        garbage collector breaks that cycle it finalizes the iterator's queues (weakref callbacks) before calling
        its shutdown, the shutdown message is lost and each worker waits out its 5 s poll before exiting (10 s at
        the end of a run, measured). The run closes its loaders itself (`streamed.close_all`, and on an error or
        stop in an epoch, `StreamBatches`)."""
        loader = getattr(self, "loader", None)  # None when __init__ failed before making it
        if hasattr(getattr(loader, "_iterator", None), "_shutdown_workers"):  # a worker iterator: stop, then drop it
            stop_workers(loader._iterator)
            loader._iterator = None

    def __del__(self) -> None:  # when the run drops its loaders, before the garbage collector breaks the cycle
        self.close()

    def __len__(self) -> int:
        """Batches left in the epoch being trained on, on this rank."""
        return max(0, len(self.loader) - self.skip)

    def __iter__(self) -> StreamBatches:
        return StreamBatches(iter(self.loader), self.close)

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, int] | None:
        return dict(self.epoch) if self.epoch else None

    def load_state_dict(self, state: dict[str, int] | None) -> None:
        self.epoch = dict(state) if state else None

    # ------------------------------------------------------------------ epochs
    def start_epoch(self, epoch: int, samples_done: int) -> None:
        """Epoch `epoch` (from 0), of which `samples_done` samples (over all ranks) were trained on already."""
        saved = self.epoch if self.epoch and self.epoch["epoch"] == epoch else None
        order = (
            Topology(**{k: saved[k] for k in ("world_size", "num_workers", "batch_size")}) if saved else self.topology
        )
        same_grid = order == replace(self.topology, num_workers=order.num_workers)
        replay = order != self.topology and same_grid and self.replan is not None
        self._use_workers(order.num_workers if replay else self.topology.num_workers)
        if replay:
            log.warning(
                "this epoch started with data.num_workers=%d: it finishes with %d, so LitData replays its order "
                "exactly; from the next epoch on data.num_workers=%d, whose order differs (LitData deals chunks to "
                "workers), so the run will not match an uninterrupted one bit for bit; no sample repeats or is skipped",
                *(order.num_workers, order.num_workers, self.topology.num_workers),
            )
        self.skip = 0
        # LitData counts epochs from 1, one per pass over its loader: a fresh loader's next pass is its epoch 1.
        if samples_done or self.loader.current_epoch != epoch:
            self.loader.load_state_dict(self._litdata_state(epoch + 1, samples_done, order))
            rounded = samples_done - samples_done % self.topology.global_batch
            self.skip = rounded // self.topology.global_batch
            if order != self.topology and not replay:
                log.warning(self._elastic_note(order, samples_done - rounded))
        self.epoch = {"epoch": epoch, **asdict(order)}

    def _litdata_state(self, litdata_epoch: int, samples_done: int, order: Topology) -> dict[str, Any]:
        """LitData's own resume state (what `StreamingDataLoader.state_dict` returns) for a position the run knows:
        built with LitData's `StreamingDataset.state_dict`, then given the topology the epoch started with."""
        per_rank = samples_done // order.world_size
        dataset = self.dataset
        dataset.current_epoch = litdata_epoch
        state = dataset.state_dict(per_rank, order.num_workers, order.batch_size)
        state.update(
            world_size=order.world_size,
            sample_in_epoch=samples_done,
            initial_world_size=order.world_size,
            initial_num_workers=max(1, order.num_workers),
            initial_batch_size=order.batch_size,
        )
        batches = per_rank // order.batch_size
        return {
            "dataset": state,
            "current_epoch": litdata_epoch,
            "num_samples_yielded": per_rank,
            "latest_worker_idx": (batches - 1) % max(1, order.num_workers),  # the worker of the last batch trained
        }

    def _elastic_note(self, order: Topology, replayed: int) -> str:
        again = (
            f"{replayed} samples are seen again (it rounds the position down to whole global batches) and "
            if replayed
            else ""
        )
        return (
            f"this epoch started with {order.world_size} rank(s) x batch {order.batch_size} and now runs with "
            f"{self.topology.world_size} x {self.topology.batch_size}: LitData re-deals the rest of it onto the new "
            f"ranks ({again}each worker's last incomplete batch is left out), and later epochs follow the new "
            "order, so the run will not match an uninterrupted one bit for bit"
        )
