"""Pre-flight: before the first batch, check the limits that make DataLoaders fail or crawl, one warning line each.

Shared memory (/dev/shm) for the batches the workers keep in flight, CPUs for the workers, the open-files
limit, the dataset's file system and the thread settings. The numbers, the versions and the warnings become
metrics.json's `environment`.

Every rank checks its own process (a few milliseconds, no exchange), but only local rank 0 logs: these limits
belong to the node (one /dev/shm, one set of CPUs, the same mounts), so one line per node says it, and a node
with a smaller /dev/shm than the others still gets its own line.
"""

from __future__ import annotations

import logging
import math
import os
import time
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.data import DataLoader

from imgtrain.config.datasets import Decode, GpuDecoder
from imgtrain.config.schema import Config, Mode
from imgtrain.data import decoders, region_probe
from imgtrain.data.datasets import EncodedFileDataset, ImageFileDataset
from imgtrain.data.pipeline import RunData
from imgtrain.data.scaled_decode import binding
from imgtrain.data.streamed import StreamedSplit
from imgtrain.data.user_datasets import UserDataset
from imgtrain.host import dist
from imgtrain.metrics.environment import ProbePaths, fingerprint, fs_kind, guarded

log = logging.getLogger(__name__)

SHM_SAFETY = 0.5  # warn when the batches in flight would fill more than this share of the free /dev/shm
# Open files of a training process besides the batches: 19 measured on CPU (debug=fast, 2 workers); CUDA,
# NCCL, TensorBoard and checkpoint writes add some: a wide margin.
BASE_OPEN_FILES = 256
SIZE_SAMPLE = 64  # files stat'ed to estimate the mean encoded JPEG (dataset.decode=cuda)
TORCH_DEFAULT_PREFETCH = 2  # what DataLoader uses when prefetch_factor is None and there are workers


@dataclass
class LoaderLoad:
    """What one process's DataLoaders ask of the machine at most, at one time."""

    workers: int  # worker processes per loader
    local_ranks: int  # training processes on this node
    shm_bytes: int  # batches held in /dev/shm by this process's workers: the larger of train and val
    shm_detail: str  # how shm_bytes was counted (said in the warning)
    shm_batch_key: str  # the batch-size setting of the loader that holds the most
    tensors: int  # tensors in flight from the workers (one open file each under file_descriptor sharing)
    data_root: str | None  # dataset.root (else the folder of the first image): where the images are read
    reads_files: bool  # images are read from files while training (not held in memory)


def _size(n: float) -> str:
    return f"{n / 1e9:.1f} GB" if n >= 1e9 else f"{n / 1e6:.1f} MB"


# ----------------------------------------------------------------------------- the checks (pure functions)
def check_shm(need: int, free: int | None, detail: str, batch_key: str = "data.batch_size") -> str | None:
    """`need`: bytes the node's loaders may hold in /dev/shm; `free`: what is free there."""
    if free is None or need == 0 or need <= SHM_SAFETY * free:
        return None
    return (
        f"/dev/shm has {_size(free)} free and the DataLoader workers of this node may hold {_size(need)} of "
        f"batches there ({detail}): a worker would fail with 'No space left on device' or 'Bus error'. Give the "
        "container more (docker run --shm-size=8g, or --ipc=host), or lower data.prefetch_factor, "
        f"data.num_workers or {batch_key}"
    )


def _processes(n: int) -> str:
    return f"{n} training process{'' if n == 1 else 'es'}"


def check_cpus(workers: int, local_ranks: int, affinity: int, quota: float | None) -> str | None:
    """Each training process and each of its workers wants a core of its own."""
    cpus = affinity if quota is None else min(affinity, quota)
    need = (workers + 1) * local_ranks
    if need <= cpus:
        return None
    quota_binds = quota is not None and quota < affinity
    where = f"a cgroup CPU quota of {quota:g}" if quota_binds else "the CPU affinity"
    fits = max(0, math.floor(cpus / local_ranks) - 1)
    auto = " (data.num_workers=auto counts the quota too)" if quota_binds else ""
    return (
        f"{need} busy processes ({_processes(local_ranks)} x (data.num_workers={workers} + 1)) on {cpus:g} CPU(s) "
        f"allowed by {where}: they will time-share the cores. Use data.num_workers={fits}{auto}"
    )


def check_open_files(
    soft: int | None, hard: int | None, workers: int, tensors: int, strategy: str | None
) -> str | None:
    """Under the file_descriptor sharing strategy every tensor a worker hands over is an open file, held by the
    worker and again by the training process while it receives it."""
    need = BASE_OPEN_FILES + 2 * tensors
    if workers == 0 or soft is None or strategy != "file_descriptor" or soft >= need:
        return None
    raise_to = hard if hard is not None and hard >= need else max(need, 65536)
    return (
        f"the open-files limit (ulimit -n) is {soft}, and the DataLoader workers pass batches as open files (torch "
        f"sharing strategy file_descriptor, {tensors} tensors in flight, about {need} files needed): expect 'Too "
        f"many open files' or 'received 0 items of ancdata'. Raise it before starting (ulimit -n {raise_to}), or "
        "call torch.multiprocessing.set_sharing_strategy('file_system')"
    )


def check_filesystem(root: str | None, fstype: str | None, mount_point: str | None) -> str | None:
    """Network, FUSE and overlay file systems read small image files slower than a local disk."""
    kind = fs_kind(fstype)
    if root is None or kind is None:
        return None
    why = {
        "network": "every file open and read crosses the network",
        "FUSE": "every read goes through a user-space process",
        "overlay": "a container's own layers, not a mounted volume",
    }[kind]
    return (
        f"the dataset ({root}) is on {fstype} at {mount_point}, a {kind} file system ({why}): reading images is "
        "slower than from a local disk. Copy the data to a local disk (or mount it as a volume), or use more "
        "data.num_workers to hide the latency"
    )


def check_threads(threads: int, local_ranks: int, cpus: float, workers: int, omp: str | None) -> str | None:
    """torch's intra-op threads of every training process share the node's CPUs."""
    if threads * local_ranks <= cpus:
        return None
    unset = " (OMP_NUM_THREADS is unset; torchrun sets it to 1 only when it starts more than one process)"
    fits = max(1, math.floor(cpus / local_ranks) - workers)
    each = "the training process" if local_ranks == 1 else f"each of {_processes(local_ranks)}"
    return (
        f"torch runs {threads} threads in {each} on {cpus:g} CPU(s){unset if omp is None else ''}: they "
        f"oversubscribe the CPUs, and the DataLoader workers' too. Set OMP_NUM_THREADS={fits}"
    )


def warnings_for(load: LoaderLoad, env: dict[str, Any]) -> list[str]:
    """Every check against the probed `env` (an `environment.fingerprint`): the lines to warn, in order."""
    ranks, cpus, workers = load.local_ranks, env["cpus_available"], load.workers
    files = (env["open_files_soft"], env["open_files_hard"], workers, load.tensors, env["sharing_strategy"])
    found = [
        check_shm(load.shm_bytes * ranks, env["shm_free_bytes"], load.shm_detail, load.shm_batch_key),
        check_cpus(workers, ranks, env["cpus_affinity"], env["cpu_quota"]),
        check_open_files(*files),
        check_filesystem(load.data_root, env["data_fs_type"], env["data_mount_point"]) if load.reads_files else None,
        check_threads(env["torch_threads"], ranks, cpus, workers, env["omp_num_threads"]),
    ]
    return [line for line in found if line]


# ----------------------------------------------------------------------------- the run's loaders
def _mean_file_size(dataset: ImageFileDataset) -> int:
    step = max(1, len(dataset) // SIZE_SAMPLE)
    sizes = [os.stat(dataset.path(i)).st_size for i in range(0, len(dataset), step)[:SIZE_SAMPLE]]
    return round(sum(sizes) / len(sizes))


def loader_load(settings: Config, info: dist.DistInfo, data: RunData, num_workers: int | None = None) -> LoaderLoad:
    """The load of `data`'s loaders, with `num_workers` workers each when given (a later choice of workers)."""
    workers = data.loader_args["train"]["num_workers"] if num_workers is None else num_workers
    files = data.bundle.train if isinstance(data.bundle.train, ImageFileDataset) else None
    encoded = isinstance(files, EncodedFileDataset)  # workers hand over JPEG bytes, one tensor per image
    # uint8 [3, S, S] per decoded image (datasets.py): 4x less than float32
    image_bytes = (guarded(_mean_file_size, files) or 0) if encoded else 3 * data.bundle.image_size**2
    prefetch = (settings.data.prefetch_factor or TORCH_DEFAULT_PREFETCH) if workers else 0
    # Training and validation alternate, so the larger of the two is what /dev/shm must hold. No train
    # DataLoader with data.device_resident or mode=compute; validation runs in mode=train only.
    loaders = {"train": data.train} if isinstance(data.train, DataLoader) else {}
    loaders.update({"val": data.val} if settings.mode == Mode.train else {})
    # A loader never has more batches ahead than its epoch has (a 64-image val split is one batch).
    ahead = {split: min(workers * prefetch, len(loader)) for split, loader in loaders.items()}
    held = {split: ahead[split] * data.loader_args[split]["batch_size"] for split in loaders}
    split = max(held, key=held.__getitem__, default="train")
    batches, batch = ahead.get(split, 0), data.loader_args[split]["batch_size"]
    per_image = f"{_size(image_bytes)} per encoded image" if encoded else f"{_size(image_bytes)} per image"
    return LoaderLoad(
        workers=workers,
        local_ranks=info.local_world_size,
        shm_bytes=batches * batch * image_bytes,
        shm_detail=(
            f"{_processes(info.local_world_size)} x {batches} {split} batches ahead ({workers} workers x "
            f"data.prefetch_factor={prefetch}) x {batch} images x {per_image}"
        ),
        shm_batch_key="data.batch_size" if split == "train" else "data.val_batch_size",
        tensors=batches * ((batch + 1) if encoded else 2),  # images + labels, or every image's bytes
        data_root=_root(settings) or (os.path.dirname(files.path(0)) if files is not None and len(files) else None),
        reads_files=files is not None,
    )


def _root(settings: Config) -> str | None:
    root = getattr(settings.dataset, "root", None)
    return None if root is None else os.path.abspath(os.path.expanduser(str(root)))


def _decoder_in_use(settings: Config, data: RunData) -> str:
    if getattr(settings.dataset, "decode", Decode.cpu) == Decode.cuda:
        if getattr(settings.dataset, "gpu_decoder", GpuDecoder.torchvision) == GpuDecoder.nvimgcodec:
            return region_probe.describe()
        return "nvJPEG (torchvision.io.decode_jpeg on the GPU)"
    if isinstance(data.bundle.train, ImageFileDataset | StreamedSplit):  # files decoded by the workers
        scaled = getattr(data.bundle.train, "scaled", False)  # dataset.scaled_decode
        return decoders.describe() + (f"; JPEGs at 1/2-1/8 scale where the crop allows ({binding()})" if scaled else "")
    if isinstance(data.bundle.train, UserDataset):  # dataset=custom: its own __getitem__ reads and decodes
        return f"{data.bundle.train.source}.__getitem__ (dataset=custom), timed as the decode stage"
    return "none (images held in memory)"


def preflight(
    settings: Config,
    info: dist.DistInfo,
    device: torch.device,
    data: RunData,
    num_workers: int | None = None,
    paths: ProbePaths | None = None,
) -> dict[str, Any]:
    """Check the host against `data`'s loaders (with `num_workers` when a later step picks the workers), warn
    once per node, and return the fingerprint with the warnings: metrics.json's `environment`."""
    started = time.perf_counter()
    load = loader_load(settings, info, data, num_workers)
    decode = str(getattr(settings.dataset, "decode", Decode.cpu))
    env = fingerprint(device, decode, load.data_root, paths or ProbePaths())
    env["decoder"]["in_use"] = _decoder_in_use(settings, data)
    env["loader_shm_bytes"] = load.shm_bytes * load.local_ranks  # the node's, at most
    env["warnings"] = warnings_for(load, env)
    if info.local_rank == 0:
        for line in env["warnings"]:
            log.warning(line)
    env["probe_ms"] = round((time.perf_counter() - started) * 1e3, 1)
    log.info(
        "pre-flight: /dev/shm %s free (the loaders may hold %s), %g CPUs, ulimit -n %s, dataset on %s, %d warning(s)",
        *(_size(env["shm_free_bytes"] or 0), _size(env["loader_shm_bytes"]), env["cpus_available"]),
        *(env["open_files_soft"] or "unlimited", env["data_fs_type"] or "-", len(env["warnings"])),
    )
    return env
