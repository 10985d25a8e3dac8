"""The one distributed path: torchrun's environment variables in, a process group (or none) out."""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from imgtrain.config import ConfigError


@dataclass(frozen=True)
class DistInfo:
    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    local_world_size: int = 1

    @property
    def enabled(self) -> bool:
        return self.world_size > 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def dist_info_from_env() -> DistInfo:
    """Read RANK, LOCAL_RANK, WORLD_SIZE and LOCAL_WORLD_SIZE as torchrun sets them (defaults: one process)."""
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    return DistInfo(
        rank=int(os.environ.get("RANK", "0")),
        local_rank=int(os.environ.get("LOCAL_RANK", "0")),
        world_size=world_size,
        local_world_size=int(os.environ.get("LOCAL_WORLD_SIZE", str(world_size))),
    )


def resolve_device(requested: str, info: DistInfo) -> torch.device:
    """`auto` picks CUDA when present; each process takes the GPU of its LOCAL_RANK."""
    has_cuda = torch.cuda.is_available()
    if requested == "cuda" and not has_cuda:
        raise ConfigError("trainer.device=cuda but no CUDA GPU is visible: use trainer.device=auto or cpu")
    if requested == "cpu" or not has_cuda:
        return torch.device("cpu")
    if info.local_rank >= torch.cuda.device_count():
        raise ConfigError(
            f"LOCAL_RANK={info.local_rank} but only {torch.cuda.device_count()} GPU(s) are visible: "
            "start at most one process per GPU (torchrun --nproc_per_node) or use trainer.device=cpu"
        )
    return torch.device("cuda", info.local_rank)


def setup(info: DistInfo, device: torch.device, timeout_s: float = 600.0) -> None:
    """Join the process group (nccl on GPU, gloo on CPU); a no-op for a single process."""
    if not info.enabled or dist.is_initialized():
        return
    if device.type == "cuda":
        torch.cuda.set_device(device)
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend=backend, timeout=timedelta(seconds=timeout_s))


def teardown() -> None:
    """Leave the process group so the next job of a sweep (or the interpreter) starts clean."""
    if dist.is_initialized():
        dist.destroy_process_group()


def all_reduce_sum(values: list[float], device: torch.device) -> list[float]:
    """Sum a few floats over all ranks (one collective); the identity for a single process."""
    if not dist.is_initialized():
        return list(values)
    tensor = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(tensor)
    return tensor.tolist()


def all_reduce_max(values: list[float], device: torch.device) -> list[float]:
    """Element-wise max over all ranks; the identity for a single process."""
    if not dist.is_initialized():
        return list(values)
    tensor = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return tensor.tolist()
