"""The `data` group's schema: every DataLoader knob (conf/data/)."""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any

from torch.utils.data import DataLoader

from imgtrain.config.fields import AUTO, TUNE, AugmentOn, Choice, at_least, auto_or_bool, checked, is_int


class LoaderEngine(Choice):
    """What makes the training batches: worker processes (torch's DataLoader) or loader threads in the training
    process (torchdata.nodes; docs/engine-evaluation/threads.md)."""

    dataloader = "dataloader"
    threads = "threads"
    tune = "tune"  # with data.num_workers=tune: its probe measures both engines and keeps the cheaper one ahead


class StartMethod(Choice):
    fork = "fork"
    spawn = "spawn"
    forkserver = "forkserver"


def _workers(value: Any) -> str | None:
    ok = value in (AUTO, TUNE) or (is_int(value) and value >= 0)
    return None if ok else "expected an integer >= 0, auto or tune"


def _in_order(value: bool) -> str | None:
    return None if value or "in_order" in inspect.signature(DataLoader).parameters else "needs torch >= 2.6"


@dataclass
class DataConfig:
    """Every DataLoader knob. Each one is overridable as data.<key>=..."""

    batch_size: int = checked(64, at_least(1, note="images per process"))  # global: x world_size
    # dataloader: num_workers worker processes; threads: num_workers loader threads in the training process (no
    # process start, pickling or /dev/shm; Python-level per-sample work shares the GIL); tune: chosen by
    # data.num_workers=tune's probe. Training split only
    engine: LoaderEngine = LoaderEngine.dataloader
    # auto: CPUs of this process / local world size, minus a core for each of the training process's own threads
    # (the training thread; on CUDA the pin-memory thread and, with dataset.decode=cuda, the decode thread)
    num_workers: Any = checked(AUTO, _workers)
    # num_workers=tune: before training, probe the model alone and the loader at a few worker counts in
    # interleaved rounds (this many seconds in all, fewer once the choice is separated) and keep the fewest
    # workers that stay 1.25x ahead of the model
    tune_budget_s: float = checked(20.0, lambda v: None if v >= 2 else "expected seconds >= 2")
    pin_memory: bool = True  # page-locked host buffers; only meaningful with CUDA (turned off on CPU)
    prefetch_factor: int | None = checked(2, at_least(1, null=""))  # batches ahead per worker
    # each worker makes this many samples of a step's batch at a time (a divisor of batch_size), joined into the
    # step's batch on the device: a slow file stalls a slice, not a whole batch (data/slices.py). null: whole
    # batches, until a measurement with many workers shows slices ahead (2 workers on 2 cores: 0.97-0.98x).
    # Training split, worker processes only
    worker_batch_size: int | None = checked(None, at_least(1, null="whole batches"))
    persistent_workers: bool = True  # keep workers alive across epochs instead of re-forking them
    # false: a batch a worker finishes early may come before an earlier, slower one. A mid-epoch resume then
    # repeats and skips up to num_workers x prefetch_factor batches of that epoch (it resumes by position)
    in_order: bool = checked(True, _in_order)
    drop_last: bool = True  # training only: avoids a tiny last batch (noisy BatchNorm, uneven DDP ranks)
    shuffle: bool = True  # training only; under DDP the DistributedSampler shuffles instead
    distributed_sampler: Any = checked(AUTO, auto_or_bool)  # auto: on under DDP
    multiprocessing_context: StartMethod | None = None  # null: the platform's default
    timeout: float = checked(0.0, at_least(0, "seconds", note="0 waits forever"))  # for a batch from a worker
    seed_workers: bool = True  # seed python/numpy/torch in each worker so augmentation is reproducible
    val_batch_size: int | None = checked(None, at_least(1, null=""))  # null: 2 x batch_size
    # crop, resize and flip where: auto, workers or device (data/resample.py: two matmuls for the whole batch)
    augment_on: AugmentOn = AugmentOn.auto
    device_resident: bool = False  # whole training set as one uint8 tensor on the device, batched crop/flip there
    prefetch_to_device: bool = True  # on CUDA with pin_memory: copy the next batch on a side stream
    max_bad_samples: int | None = checked(100, at_least(0, null="no limit"))
    stage_timings: bool = True  # time read/decode/augment/collate in the workers, transfer and copy in the loop
