"""The one distributed path: torchrun's environment variables in, a process group (or none) out."""

from __future__ import annotations

import contextlib
import itertools
import json
import logging
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import datetime, timedelta
from functools import cache
from typing import Any

import psutil
import torch
import torch.distributed as dist
from omegaconf import OmegaConf

from imgtrain.common.errors import ConfigError, RunError
from imgtrain.host import slurm

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class DistInfo:
    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    local_world_size: int = 1
    launched: bool = False  # started by torchrun: even one process then joins a process group (nanoGPT's rule)

    @property
    def enabled(self) -> bool:
        return self.world_size > 1 or self.launched

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def export_submitit_env() -> None:
    """Under a submitit task (SLURM or local), export torchrun-style variables so the one env:// path works."""
    if "SUBMITIT_EXECUTOR" not in os.environ or "RANK" in os.environ:
        return
    from submitit.helpers import TorchDistributedEnvironment

    # CUDA_VISIBLE_DEVICES stays as SLURM set it: each task then picks the GPU of its LOCAL_RANK.
    TorchDistributedEnvironment().export(set_cuda_visible_devices=False)


def global_rank() -> int:
    """This process's rank before any process group exists (torchrun, SLURM/submitit, or 0)."""
    if "RANK" in os.environ:
        return int(os.environ["RANK"])
    if "SUBMITIT_EXECUTOR" in os.environ:
        from submitit import JobEnvironment

        return JobEnvironment().global_rank
    return 0


@cache
def launch_time() -> datetime:
    """A start time every rank on this node agrees on, so they resolve the same Hydra run directory.

    Hydra's `${now:...}` is evaluated in each process, and ranks start a few milliseconds apart, which can
    straddle a second. Under torchrun every worker is a child of the same agent process, so its start time is
    shared; under submitit each task keeps the job's directory already. Elsewhere: this process's start.
    """
    if "TORCHELASTIC_RUN_ID" in os.environ:
        return datetime.fromtimestamp(int(psutil.Process(os.getppid()).create_time()))
    return datetime.now()


def _rank_zero_only(value, fallback=None):
    """`value` on rank 0, `fallback` elsewhere: only rank 0 writes Hydra's .hydra/ and the log file."""
    return value if global_rank() == 0 else fallback


def register_resolvers() -> None:
    """`${launch_time:...}` and `${rank_zero_only:...}`, which conf/config.yaml uses for the run directory."""
    # use_cache, as Hydra's own `now`: the value travels with the pickled config to submitit jobs, requeued
    # ones included, so they find the same run directory (and resume from its checkpoints).
    OmegaConf.register_new_resolver(
        "launch_time", lambda fmt: launch_time().strftime(fmt), replace=True, use_cache=True
    )
    OmegaConf.register_new_resolver("rank_zero_only", _rank_zero_only, replace=True)


def dist_info_from_env() -> DistInfo:
    """Read RANK, LOCAL_RANK, WORLD_SIZE and LOCAL_WORLD_SIZE as torchrun sets them (defaults: one process); in a
    Slurm job, rank 0 logs which job, array index and attempt this run is."""
    export_submitit_env()
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    info = DistInfo(
        rank=int(os.environ.get("RANK", "0")),
        local_rank=int(os.environ.get("LOCAL_RANK", "0")),
        world_size=world_size,
        local_world_size=int(os.environ.get("LOCAL_WORLD_SIZE", str(world_size))),
        launched="TORCHELASTIC_RUN_ID" in os.environ,
    )
    job = slurm.current_job()
    if job is not None and info.is_main:
        log.info("%s", job.describe())
    return info


def resolve_device(requested: str, info: DistInfo) -> torch.device:
    """`auto` picks CUDA when present; each process takes the GPU of its LOCAL_RANK.

    A process that sees exactly one GPU through its own CUDA_VISIBLE_DEVICES uses it whatever its LOCAL_RANK:
    SLURM's `--gpus-per-task=1` shows each task its own GPU only, as device 0. (Without that variable, several
    processes seeing one GPU share it: an error, below.)
    """
    has_cuda = torch.cuda.is_available()
    if requested == "cuda" and not has_cuda:
        raise ConfigError("system.device=cuda but no CUDA GPU is visible: use system.device=auto or cpu")
    if requested == "cpu" or not has_cuda:
        return torch.device("cpu")
    visible = torch.cuda.device_count()
    if visible == 1 and (info.local_world_size == 1 or "CUDA_VISIBLE_DEVICES" in os.environ):
        return torch.device("cuda", 0)
    if max(info.local_rank + 1, info.local_world_size) > visible:
        raise ConfigError(
            f"{info.local_world_size} processes on this node but only {visible} GPU(s) are "
            "visible: start at most one process per GPU (torchrun --nproc_per_node) or use system.device=cpu"
        )
    return torch.device("cuda", info.local_rank)


_job_counter = itertools.count()
_host_group: dist.ProcessGroup | None = None  # gloo, for small host-side exchanges that must not sync the GPU


@cache
def _rendezvous_store(timeout_s: float) -> dist.Store:
    """The env:// store (torchrun's agent store, or one hosted by rank 0), made once per process."""
    store, _, _ = next(dist.rendezvous("env://", timeout=timedelta(seconds=timeout_s)))
    return store


def setup(info: DistInfo, device: torch.device, timeout_s: float = 600.0) -> None:
    """Join the process group (nccl on GPU, gloo on CPU); a no-op for a single process."""
    if not info.enabled or dist.is_initialized():
        return
    if device.type == "cuda":
        torch.cuda.set_device(device)
    backend = "nccl" if device.type == "cuda" else "gloo"
    # A sweep inside torchrun sets up one process group per job in the same processes. Every rank runs the
    # same jobs in the same order, so a per-job key prefix keeps each group's rendezvous keys apart; without
    # it the second group would read the first one's stale addresses from the shared store.
    # torchrun --max-restarts starts new workers against the same agent store: the restart count keeps apart too.
    restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    store = dist.PrefixStore(f"imgtrain/r{restart}/job{next(_job_counter)}", _rendezvous_store(timeout_s))
    # device_id: NCCL binds the communicator to this GPU now, instead of guessing it at the first collective.
    bound = {"device_id": device} if backend == "nccl" else {}
    dist.init_process_group(
        backend=backend,
        store=store,
        rank=info.rank,
        world_size=info.world_size,
        timeout=timedelta(seconds=timeout_s),
        **bound,
    )
    global _host_group
    _host_group = dist.new_group(backend="gloo") if backend == "nccl" else None  # None: the gloo default group
    log.info("process group: %s, rank %d of %d, on %s", backend, info.rank, info.world_size, device)


@contextlib.contextmanager
def main_process_first(info: DistInfo) -> Iterator[None]:
    """Rank 0 runs the block first (e.g. generating a dataset), the other ranks after it has finished."""
    if info.enabled and not info.is_main:
        dist.barrier()
    yield
    if info.enabled and info.is_main:
        dist.barrier()


def barrier() -> None:
    """Wait for every rank; a no-op for a single process."""
    if dist.is_initialized():
        dist.barrier()


def _encoded(value: Any) -> torch.Tensor:
    """`value` as JSON bytes (TypeError for anything but plain data: str, numbers, bool, None, lists, dicts)."""
    return torch.frombuffer(bytearray(json.dumps(value).encode()), dtype=torch.uint8)


def _decoded(payload: torch.Tensor) -> Any:
    return json.loads(payload.numpy().tobytes())


def broadcast_plain(value: Any, info: DistInfo) -> Any:
    """Rank 0's `value` on every rank, as JSON: plain data only (tuples arrive as lists, on rank 0 too). Not
    torch's object collectives, which unpickle what a peer sends: the rendezvous store takes any process that
    connects, so a peer's bytes are parsed, never run. On the CPU (gloo): no GPU sync."""
    if not info.enabled:
        return json.loads(json.dumps(value))
    payload = _encoded(value) if info.is_main else torch.empty(0, dtype=torch.uint8)
    size = torch.tensor([payload.numel()], dtype=torch.int64)
    dist.broadcast(size, src=0, group=_host_group)
    if not info.is_main:
        payload = torch.empty(int(size), dtype=torch.uint8)
    dist.broadcast(payload, src=0, group=_host_group)
    return _decoded(payload)


def all_gather_floats(values: list[float], device: torch.device) -> list[list[float]]:
    """Every rank's `values` (one collective); a one-row list for a single process."""
    if not dist.is_initialized():
        return [list(values)]
    tensor = torch.tensor(values, dtype=torch.float64, device=device)
    gathered = [torch.empty_like(tensor) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, tensor)
    return [row.tolist() for row in gathered]


def teardown() -> None:
    """Leave the process group so the next job of a sweep (or the interpreter) starts clean."""
    global _host_group
    if dist.is_initialized():
        dist.destroy_process_group()
    _host_group = None


def all_gather_host(values: list[float]) -> list[list[float]]:
    """Every rank's `values`, exchanged on the CPU (gloo): no GPU sync. One row for a single process."""
    if not dist.is_initialized():
        return [list(values)]
    tensor = torch.tensor(values, dtype=torch.float64)
    rows = [torch.empty_like(tensor) for _ in range(dist.get_world_size())]
    dist.all_gather(rows, tensor, group=_host_group)
    return [row.tolist() for row in rows]


def all_gather_plain(value: Any) -> list[Any]:
    """Every rank's `value`, plain data as JSON (see `broadcast_plain`; for rare events); a one-item list for a
    single process."""
    if not dist.is_initialized():
        return [json.loads(json.dumps(value))]
    payload = _encoded(value)
    sizes = [int(row[0]) for row in all_gather_host([payload.numel()])]
    padded = torch.zeros(max(sizes), dtype=torch.uint8)
    padded[: payload.numel()] = payload
    rows = [torch.empty_like(padded) for _ in sizes]
    dist.all_gather(rows, padded, group=_host_group)
    return [_decoded(row[:size]) for row, size in zip(rows, sizes, strict=True)]


def all_reduce_sum(values: list[float], device: torch.device) -> list[float]:
    """Sum a few floats over all ranks (one collective); the identity for a single process."""
    if not dist.is_initialized():
        return list(values)
    tensor = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(tensor)
    return tensor.tolist()


# What a collective raises on a rank whose peer has gone (its process ended): gloo's TCP pair, NCCL's watchdog.
_PEER_GONE = ("Connection closed by peer", "Connection reset by peer", "remote process exited", "NCCL communicator")


def lost_peer(error: BaseException, info: DistInfo) -> RunError | None:
    """The one line for a collective that failed because another rank ended (it prints its own reason), or None
    for any other error. Without it, each surviving rank would print the transport's traceback."""
    if not info.enabled or not isinstance(error, RuntimeError):
        return None
    message = str(error)
    if not (isinstance(error, dist.DistError) or any(sign in message for sign in _PEER_GONE)):
        return None
    cause = re.sub(r"^\[[^\]]*\]\s*", "", message.strip().splitlines()[0])  # gloo prefixes its source line
    cause = cause.split(". ")[0][:160]
    return RunError(
        f"rank {info.rank} stopped: another rank ended during a collective ({cause}). That rank's own line says "
        "why; run the same command again to continue from the last checkpoint"
    )
