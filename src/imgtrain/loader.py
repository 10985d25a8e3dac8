"""DataLoader construction: `data.*` settings in, effective DataLoader arguments out, with every adjustment said."""

from __future__ import annotations

import logging
import os
import random
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler, Sampler

from imgtrain.config import AUTO, DataConfig

log = logging.getLogger(__name__)

# `auto` never starts more workers than this per process: past ~16, start-up time and memory grow faster
# than throughput for the per-sample pipelines this template targets (see docs/loader-tuning-notes).
MAX_AUTO_WORKERS = 16


def available_cpus() -> int:
    """CPUs this process may run on (honours taskset, cgroups cpusets and SLURM bindings)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # macOS and Windows have no sched_getaffinity
        return os.cpu_count() or 1


def auto_num_workers(local_world_size: int = 1, cpus: int | None = None) -> int:
    """Workers per process: this process's share of the CPUs, minus one core for the main (training) process."""
    cpus = available_cpus() if cpus is None else cpus
    share = cpus // max(1, local_world_size)
    return max(0, min(MAX_AUTO_WORKERS, share - 1))


def seed_worker(worker_id: int) -> None:
    """Seed Python and NumPy in each worker from the per-worker torch seed the DataLoader already derived."""
    seed = torch.initial_seed() % 2**32
    np.random.seed(seed)
    random.seed(seed)


@dataclass
class LoaderPlan:
    """The effective DataLoader arguments for one split, and the notes on how they were derived."""

    kwargs: dict[str, Any]
    notes: list[str] = field(default_factory=list)
    use_distributed_sampler: bool = False

    def describe(self) -> dict[str, Any]:
        """JSON-friendly view of the arguments (for logs, metrics.json and TensorBoard hparams)."""
        shown = {k: v for k, v in self.kwargs.items() if k not in ("worker_init_fn", "generator")}
        shown["distributed_sampler"] = self.use_distributed_sampler
        shown["seed_workers"] = self.kwargs.get("worker_init_fn") is not None
        return shown


def plan_loader(
    data: DataConfig,
    *,
    train: bool,
    device_type: str,
    world_size: int = 1,
    local_world_size: int = 1,
) -> LoaderPlan:
    """Resolve `auto` values and drop options PyTorch would reject, noting each change in one line."""
    notes: list[str] = []
    workers = data.num_workers
    if workers == AUTO:
        workers = auto_num_workers(local_world_size)
        notes.append(
            f"data.num_workers=auto -> {workers} ({available_cpus()} CPUs available to this process, "
            f"{local_world_size} process(es) on this node, one core kept for the training process)"
        )
    kwargs: dict[str, Any] = {
        "batch_size": data.batch_size if train else (data.val_batch_size or 2 * data.batch_size),
        "num_workers": workers,
        "pin_memory": data.pin_memory,
        "drop_last": data.drop_last if train else False,
        "shuffle": data.shuffle if train else False,
        "timeout": data.timeout,
    }
    if data.pin_memory and device_type != "cuda":
        kwargs["pin_memory"] = False
        notes.append(f"data.pin_memory=true has no effect on {device_type}: using false")
    if workers > 0:
        kwargs["prefetch_factor"] = data.prefetch_factor
        kwargs["persistent_workers"] = data.persistent_workers
        kwargs["multiprocessing_context"] = data.multiprocessing_context
    else:
        ignored = _worker_only_settings(data)
        if ignored:
            notes.append(f"data.num_workers=0: ignoring {', '.join(ignored)} (they need worker processes)")
        kwargs["timeout"] = 0
    if data.seed_workers:
        kwargs["worker_init_fn"] = seed_worker
    use_sampler = data.distributed_sampler is True or (data.distributed_sampler == AUTO and world_size > 1)
    if use_sampler and train and data.shuffle:
        notes.append("DistributedSampler shuffles the training set: the DataLoader itself does not")
    return LoaderPlan(kwargs=kwargs, notes=notes, use_distributed_sampler=use_sampler)


def _worker_only_settings(data: DataConfig) -> list[str]:
    """The non-default settings that only exist for worker processes."""
    ignored = []
    if data.prefetch_factor is not None:
        ignored.append(f"data.prefetch_factor={data.prefetch_factor}")
    if data.persistent_workers:
        ignored.append("data.persistent_workers=true")
    if data.multiprocessing_context is not None:
        ignored.append(f"data.multiprocessing_context={data.multiprocessing_context}")
    if data.timeout:
        ignored.append(f"data.timeout={data.timeout}")
    return ignored


class ShardSampler(Sampler[int]):
    """Evaluation sampler: rank r takes indices r, r+W, r+2W, ... with no padding, so each sample counts once.

    DistributedSampler pads the last shard with repeated samples to equalise ranks, which would bias
    validation accuracy; evaluation does not need equal step counts, because it only all-reduces at the end.
    """

    def __init__(self, dataset_len: int, rank: int, world_size: int) -> None:
        self.indices = range(rank, dataset_len, world_size)

    def __iter__(self):
        return iter(self.indices)

    def __len__(self) -> int:
        return len(self.indices)


def build_loader(
    dataset: Dataset, plan: LoaderPlan, *, train: bool, seed: int, rank: int = 0, world_size: int = 1
) -> DataLoader:
    """Build the DataLoader for `plan`; the sampler (if any) is chosen here so shuffle stays consistent."""
    kwargs = dict(plan.kwargs)
    generator = torch.Generator()
    generator.manual_seed(seed + rank)  # same seed => same shuffling order and same worker seeds
    if plan.use_distributed_sampler and train:
        shuffle = kwargs.pop("shuffle")
        kwargs["sampler"] = DistributedSampler(
            dataset,
            num_replicas=world_size,
            rank=rank,
            shuffle=shuffle,
            seed=seed,
            drop_last=kwargs["drop_last"],
        )
    elif world_size > 1 and not train:
        kwargs.pop("shuffle")
        kwargs["sampler"] = ShardSampler(len(dataset), rank, world_size)
    return DataLoader(dataset, generator=generator, **kwargs)
