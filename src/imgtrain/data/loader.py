"""DataLoader plans: `data.*` settings in, the effective DataLoader arguments out (a `LoaderPlan`), with every
adjustment said; and what the workers run (their start method, stop signals and seeds). `pipeline.build_loader`
builds the loader of a plan."""

from __future__ import annotations

import functools
import logging
import multiprocessing
import multiprocessing.forkserver
import multiprocessing.resource_tracker
import random
import signal
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from imgtrain.config.data import DataConfig, LoaderEngine
from imgtrain.config.fields import AUTO, TUNE, AugmentOn
from imgtrain.data.samplers import EpochSampler
from imgtrain.host.cpus import available_cpus, cpu_budget
from imgtrain.host.signals import STOP_SIGNALS, SUBMITIT_SIGNAL

log = logging.getLogger(__name__)

# `auto` never starts more workers than this per process: past ~16, start-up time and memory grow faster
# than throughput for the per-sample pipelines this template targets ("0.7-0.8 x logical cores, at most 16"
# is one of the common rules of thumb; `num_workers=tune` measures instead).
MAX_AUTO_WORKERS = 16


# A DataLoader worker that gets SIGTERM (SLURM signals every process of the job) lives this much longer, so
# the main process can reach the point where it saves; then it exits even if nothing else stops it.
# SLURM's default KillWait is 30 s: after that everything gets SIGKILL anyway.
WORKER_GRACE_S = 30

# Workers under a process group (torchrun) start by forkserver when data.multiprocessing_context is null. A gloo
# thread enters Python whenever it drops a tensor a collective used, and CPython 3.11 then takes its thread-list
# lock without the GIL: a worker forked at that instant waits for that lock forever (pytorch#75147; found with
# gdb, 3 hangs in ~115 runs of tests/test_ddp.py::test_sweep_inside_torchrun on 2 loaded cores). forkserver forks
# from a clean server that imports FORKSERVER_PRELOAD once (about +2.4 s per run: BENCHMARKS.md, 2026-11-24).
FORKSERVER = "forkserver"
THREAD_PREFETCH = 2  # batches in flight per loader thread: torchdata.nodes 0.11 allows no other (max_concurrent)
FORKSERVER_PRELOAD = ["__main__", "torch", "imgtrain.data.pipeline"]
# torchrun's agent and SLURM signal the whole process group, the forkserver included. A server killed by SIGTERM
# makes every worker it started look dead to PyTorch (their status reads come from it), so it starts with these
# signals blocked: they stay pending in the server, which exits anyway when its parent does. (CPython's resource
# tracker starts the same way, but then unblocks SIGINT and SIGTERM, hence its start first.)
SHIELDED_SIGNALS = {*STOP_SIGNALS, SUBMITIT_SIGNAL}


def start_forkserver() -> None:
    """Start the one forkserver of this process now (no-op when it runs), deaf to the job's stop signals."""
    multiprocessing.set_forkserver_preload(FORKSERVER_PRELOAD)  # read when the server starts
    multiprocessing.resource_tracker.ensure_running()
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, SHIELDED_SIGNALS)  # a signal now waits, is not lost
    try:
        multiprocessing.forkserver.ensure_running()  # the server inherits this thread's mask across exec
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


def worker_signals() -> None:
    """In a DataLoader worker: survive the job-wide stop signal long enough for the main process to save."""
    for signum in (signal.SIGUSR1, SUBMITIT_SIGNAL):
        signal.signal(signum, signal.SIG_IGN)  # their default action would kill the worker mid-epoch
    for signum in (signal.SIGTERM, signal.SIGINT):  # Ctrl-C too: no KeyboardInterrupt traceback from a worker
        signal.signal(signum, _worker_sigterm)
    # Only now: a forkserver's child inherits its mask, and a Ctrl-C that reached the worker while it started is
    # pending. Unblocked before the handlers were in place, it raised KeyboardInterrupt and the worker quit
    # ("exited unexpectedly" in place of the stop; seen once in tests/test_ddp.py's Ctrl-C test on 2 cores).
    signal.pthread_sigmask(signal.SIG_UNBLOCK, SHIELDED_SIGNALS)


def _worker_sigterm(signum: int, frame: Any) -> None:
    # PyTorch also sends SIGTERM to a worker that did not stop when asked: the alarm still ends it, a bit later.
    remaining = signal.alarm(0)  # an alarm already running keeps its deadline
    signal.alarm(remaining or WORKER_GRACE_S)


def auto_num_workers(local_world_size: int = 1, cpus: int | None = None, kept: int = 1) -> int:
    """Workers per process: this process's share of the CPUs, minus the `kept` cores its own threads need
    (`main_process_cores`)."""
    cpus = available_cpus() if cpus is None else cpus
    share = cpus // max(1, local_world_size)
    return max(0, min(MAX_AUTO_WORKERS, share - kept))


def main_process_cores(device_type: str, pinned: bool, gpu_decode: bool) -> tuple[int, str]:
    """The cores `auto` leaves to the training process's own threads, and which threads they are: the training
    thread (its kernel launches on a GPU); on CUDA with pinned memory the DataLoader's pin-memory thread, which
    copies every batch into page-locked memory; with dataset.decode=cuda the decode thread, which parses each JPEG
    on the host for nvJPEG. On one H200 (2026-11-27) 15 workers left one core of 16 to all of them, and the
    ResNet-18 row lost 30% to slowed launches. The prefetch thread (data/ahead.py) mostly waits: no core."""
    threads = ["the training thread"]
    if device_type == "cuda" and pinned:
        threads.append("the pin-memory thread")
    if device_type == "cuda" and gpu_decode:
        threads.append("the GPU decode thread")
    named = threads[0] if len(threads) == 1 else ", ".join(threads[:-1]) + " and " + threads[-1]
    return len(threads), named


def init_worker(worker_id: int, seed_workers: bool = True) -> None:
    """Each worker: outlive a job-wide stop signal (see guards), and seed Python and NumPy from torch's seed."""
    worker_signals()
    if seed_workers:
        seed = torch.initial_seed() % 2**32  # the per-worker seed the DataLoader already derived
        np.random.seed(seed)
        random.seed(seed)


@dataclass
class LoaderPlan:
    """The effective DataLoader arguments for one split, and the notes on how they were derived."""

    kwargs: dict[str, Any]
    notes: list[str] = field(default_factory=list)
    use_distributed_sampler: bool = False

    seed_workers: bool = True
    device_resident: bool = False
    prefetch_to_device: bool = False  # effective value: CUDA, pinned memory and data.prefetch_to_device
    stage_timings: bool = True  # data.stage_timings: each batch carries its stage seconds
    augment_on: AugmentOn = AugmentOn.workers  # effective value: auto is the workers' off CUDA
    threads: bool = False  # data.engine=threads with num_workers > 0: loader threads make the batches (data/threads.py)
    cores_kept: int = 1  # for the training process's own threads (main_process_cores): what `auto` leaves them
    slices: int = 1  # worker slices per step's batch (data.worker_batch_size, data/slices.py)

    def describe(self) -> dict[str, Any]:
        """JSON-friendly view of the arguments (for logs, metrics.json and TensorBoard hparams)."""
        shown = {k: v for k, v in self.kwargs.items() if k not in ("worker_init_fn", "generator")}
        shown["distributed_sampler"] = self.use_distributed_sampler
        shown["seed_workers"] = self.seed_workers
        shown["device_resident"] = self.device_resident
        shown["prefetch_to_device"] = self.prefetch_to_device
        shown["augment_on"] = str(self.augment_on)
        shown["engine"] = str(LoaderEngine.threads if self.threads else LoaderEngine.dataloader)
        shown["cores_kept"] = self.cores_kept
        shown["worker_batch_size"] = self.kwargs["batch_size"] // self.slices
        return shown


def resolve_workers(
    data: DataConfig, local_world_size: int = 1, device_type: str = "cpu", gpu_decode: bool = False
) -> tuple[int, str | None]:
    """data.num_workers as a count, with the line saying how `auto` (or `tune`, before its probe) chose it."""
    if data.num_workers not in (AUTO, TUNE):
        return data.num_workers, None
    cpus = cpu_budget()  # tune: the probe before training replaces auto's count (its fallback)
    kept, threads = main_process_cores(device_type, data.pin_memory, gpu_decode)
    workers = auto_num_workers(local_world_size, cpus.usable, kept)
    return workers, (
        f"data.num_workers={data.num_workers} -> {workers} ({cpus.usable} CPUs available to this process, set by "
        f"{cpus.limited_by}; {local_world_size} process(es) on this node, {kept} core(s) kept for {threads})"
        + (" until the probe before training chooses" if data.num_workers == TUNE else "")
    )


def plan_loader(
    data: DataConfig,
    *,
    train: bool,
    device_type: str,
    workers: int | None = None,
    world_size: int = 1,
    local_world_size: int = 1,
    process_group: bool = False,
    engine: LoaderEngine | None = None,
    gpu_decode: bool = False,
) -> LoaderPlan:
    """Resolve `auto` values and drop options PyTorch would reject, noting each change in one line. `workers` and
    `engine`: decided elsewhere (the ranks' agreement, num_workers=tune) in place of data.num_workers, data.engine
    (data.engine=tune plans the DataLoader until the probe chose).
    `process_group`: the run joined one (torchrun), so workers do not start by fork (see FORKSERVER).
    `gpu_decode`: dataset.decode=cuda, whose decode thread `auto` leaves a core."""
    notes: list[str] = []
    if workers is None:
        workers, note = resolve_workers(data, local_world_size, device_type, gpu_decode)
        notes += [note] if note else []
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
    threads = train and workers > 0 and (engine or data.engine) == LoaderEngine.threads
    _engine_settings(data, kwargs, notes, threads=threads, process_group=process_group)
    kwargs["worker_init_fn"] = functools.partial(init_worker, seed_workers=data.seed_workers)
    use_sampler = data.distributed_sampler is True or (data.distributed_sampler == AUTO and world_size > 1)
    if use_sampler and train and data.shuffle:
        notes.append("DistributedSampler shuffles the training set: the DataLoader itself does not")
    if data.device_resident and train:
        notes.append("data.device_resident=true: the training set lives on the device; no DataLoader for training")
    return LoaderPlan(
        kwargs=kwargs,
        notes=notes,
        use_distributed_sampler=use_sampler,
        seed_workers=data.seed_workers,
        device_resident=data.device_resident and train,
        prefetch_to_device=data.prefetch_to_device and kwargs["pin_memory"] and not (data.device_resident and train),
        stage_timings=data.stage_timings,
        augment_on=_augment_on(data.augment_on, device_type),
        threads=threads,
        cores_kept=main_process_cores(device_type, kwargs["pin_memory"], gpu_decode)[0],
        slices=_slices(data, kwargs, train=train and not threads),
    )


def _slices(data: DataConfig, kwargs: dict[str, Any], *, train: bool) -> int:
    """Worker slices of each training batch: batch_size / data.worker_batch_size (validate checked that it divides);
    whole batches with null, for validation, and for loader threads."""
    if not train or data.worker_batch_size is None:
        return 1
    return kwargs["batch_size"] // data.worker_batch_size


def _engine_settings(
    data: DataConfig, kwargs: dict[str, Any], notes: list[str], *, threads: bool, process_group: bool
) -> None:
    """The arguments of what makes the batches: loader threads, worker processes, or the training process."""
    if threads:
        _thread_settings(data, kwargs, notes)
    elif kwargs["num_workers"] > 0:
        _process_settings(data, kwargs, notes, process_group)
    else:
        ignored = _worker_only_settings(data)
        if ignored:
            notes.append(f"data.num_workers=0: ignoring {', '.join(ignored)} (they need worker processes)")
        kwargs["timeout"] = 0


def _process_settings(data: DataConfig, kwargs: dict[str, Any], notes: list[str], process_group: bool) -> None:
    """The worker processes' own arguments."""
    kwargs["prefetch_factor"] = data.prefetch_factor
    kwargs["persistent_workers"] = data.persistent_workers
    kwargs["multiprocessing_context"] = _start_method(data, process_group, notes)
    if not data.in_order:  # only when off: torch < 2.6 has no such argument (validate refuses false there)
        kwargs["in_order"] = False


def _thread_settings(data: DataConfig, kwargs: dict[str, Any], notes: list[str]) -> None:
    """data.engine=threads: the effective values of the knobs that were made for worker processes."""
    kwargs["prefetch_factor"] = THREAD_PREFETCH  # torchdata 0.11 keeps 2 x threads batches in flight, no other
    # in order, one pipeline runs from epoch to epoch (the next epoch's batches made while this one ends); out of
    # order, the threads start at every epoch (an epoch's end could overtake its batches)
    kwargs["persistent_workers"] = data.in_order
    if not data.in_order:
        kwargs["in_order"] = False
    ignored = [f"data.prefetch_factor={data.prefetch_factor}"] if data.prefetch_factor not in (None, 2) else []
    ignored += [f"data.multiprocessing_context={data.multiprocessing_context}"] if data.multiprocessing_context else []
    if ignored:
        notes.append(f"data.engine=threads: ignoring {', '.join(ignored)} (threads keep 2 batches each in flight)")


def _augment_on(augment_on: AugmentOn, device_type: str) -> AugmentOn:
    """data.augment_on's effective value: auto leaves the CPU's work in the workers off CUDA."""
    return AugmentOn.workers if augment_on == AugmentOn.auto and device_type != "cuda" else augment_on


def _start_method(data: DataConfig, process_group: bool, notes: list[str]) -> str | None:
    """How workers start: data.multiprocessing_context, or forkserver under a process group (see FORKSERVER)."""
    method = data.multiprocessing_context
    if method is None and process_group and FORKSERVER in multiprocessing.get_all_start_methods():
        method = FORKSERVER
        notes.append(f"data.multiprocessing_context=null -> {FORKSERVER} under a process group (fork can hang)")
    if method == FORKSERVER:
        start_forkserver()
    return None if method is None else str(method)


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
    if not data.in_order:  # one process reads the batches in order anyway
        ignored.append("data.in_order=false")
    return ignored


def train_sampler(dataset_len: int, plan: LoaderPlan, *, seed: int, rank: int, world_size: int) -> EpochSampler:
    """The training order: sharded under DDP unless data.distributed_sampler=false (then each rank reads it all)."""
    shard = plan.use_distributed_sampler
    return EpochSampler(
        dataset_len,
        num_replicas=world_size if shard else 1,
        rank=rank if shard else 0,
        shuffle=plan.kwargs["shuffle"],
        seed=seed if shard else seed + rank,
        drop_last=plan.kwargs["drop_last"],
    )
