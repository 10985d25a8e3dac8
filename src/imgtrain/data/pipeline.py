"""The input pipeline of a run: the dataset, the effective DataLoader arguments, the loaders and the feed."""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from hydra.utils import instantiate
from torch.utils.data import DataLoader

from imgtrain import dist
from imgtrain.config import Config, DataConfig, Decode, Mode
from imgtrain.data.datasets import DatasetBundle
from imgtrain.data.feed import DeviceBatches, Feed, build_resident
from imgtrain.data.loader import EpochSampler, LoaderPlan, build_loader, plan_loader, train_sampler
from imgtrain.errors import ConfigError
from imgtrain.host import write_json

log = logging.getLogger(__name__)


@dataclass
class RunData:
    """Everything the loop reads from: the dataset, its two loaders, and how batches reach the device."""

    bundle: DatasetBundle
    train: Any  # a DataLoader, a ResidentLoader (data.device_resident) or DeviceBatches (mode=compute)
    val: DataLoader
    loader_args: dict[str, dict[str, Any]]  # the effective DataLoader arguments, per split
    feed: Feed
    settings: DataConfig  # data.*: what the failure explanations name

    @property
    def replicas(self) -> int:
        """Ranks the training order is sharded over (1 when each rank reads the whole set)."""
        sampler = getattr(self.train, "sampler", None)
        return sampler.num_replicas if isinstance(sampler, EpochSampler) else 1

    def start_epoch(self, epoch: int, samples_done: int) -> None:
        """Set the epoch's order (the same on every rank), skipping the samples a resumed epoch already had."""
        sampler = getattr(self.train, "sampler", None)
        if isinstance(sampler, EpochSampler):
            sampler.set_epoch(epoch, start=samples_done // self.replicas)


def plan_with_workers(data: DataConfig, workers: int, device_type: str, info: dist.DistInfo) -> LoaderPlan:
    """The training loader's plan with `workers` workers in place of data.num_workers (tune's probes and choice)."""
    common = {"device_type": device_type, "world_size": info.world_size, "local_world_size": info.local_world_size}
    return plan_loader(dataclasses.replace(data, num_workers=workers), train=True, **common)


def use_tuned_workers(data: RunData, settings: Config, info: dist.DistInfo, device: torch.device, tuned: dict) -> None:
    """Rebuild the training loader with the count `data.num_workers=tune` chose, and record the probe with its
    arguments (loader_args.json is written again by `save_loader_args`)."""
    plan = plan_with_workers(settings.data, tuned["chosen"], device.type, info)
    shard = {"rank": info.rank, "world_size": info.world_size}
    data.train = build_loader(data.bundle.train, plan, train=True, seed=settings.trainer.seed, **shard)
    data.loader_args["train"] = plan.describe()
    data.loader_args["tune"] = tuned


def save_loader_args(data: RunData, info: dist.DistInfo, out_dir: Path) -> None:
    """The effective loader arguments (and the tune probe, when one ran), by rank 0."""
    if info.is_main:
        write_json(out_dir / "loader_args.json", data.loader_args)


def _format(args: dict[str, Any]) -> str:
    return " ".join(f"{k}={v}" for k, v in args.items())


def plan_loaders(settings: Config, device: torch.device, info: dist.DistInfo) -> tuple[LoaderPlan, LoaderPlan]:
    common = {"device_type": device.type, "world_size": info.world_size, "local_world_size": info.local_world_size}
    train_plan = plan_loader(settings.data, train=True, **common)
    val_plan = plan_loader(settings.data, train=False, **common)
    for note in train_plan.notes:
        log.warning(note) if note.startswith("data.num_workers=0") else log.info(note)
    log.info("DataLoader (train): %s", _format(train_plan.describe()))
    log.info("DataLoader (val):   %s", _format(val_plan.describe()))
    return train_plan, val_plan


def _check_gpu_decode(settings: Config, device: torch.device) -> bool:
    gpu_decode = getattr(settings.dataset, "decode", Decode.cpu) == Decode.cuda
    if gpu_decode and device.type != "cuda":
        raise ConfigError(
            f"dataset.decode=cuda needs a CUDA device, and this run uses {device}: use dataset.decode=cpu"
        )
    if gpu_decode and settings.data.device_resident:
        raise ConfigError("dataset.decode=cuda and data.device_resident=true do not combine: choose one")
    return gpu_decode


def build_data(
    settings: Config, info: dist.DistInfo, device: torch.device, memory_format: torch.memory_format, out_dir: Path
) -> RunData:
    """Dataset, loaders and feed; the effective loader arguments are logged, and saved by rank 0."""
    seed = settings.trainer.seed
    with dist.main_process_first(info):  # rank 0 generates `shapes` once; the others then reuse its files
        bundle = instantiate(settings.dataset, _convert_="all")
    log.info(
        "dataset %s: %d train / %d val images, %d classes, %d px",
        *(bundle.name, len(bundle.train), len(bundle.val), bundle.num_classes, bundle.image_size),
    )
    gpu_decode = _check_gpu_decode(settings, device)
    train_plan, val_plan = plan_loaders(settings, device, info)
    loader_args = {"train": train_plan.describe(), "val": val_plan.describe()}
    shard = {"rank": info.rank, "world_size": info.world_size}
    train_loader = build_loader(bundle.train, train_plan, train=True, seed=seed, **shard)
    val_loader = build_loader(bundle.val, val_plan, train=False, seed=seed, **shard)
    if len(train_loader) == 0:
        raise ConfigError(
            f"data.batch_size={settings.data.batch_size} is larger than the training split of "
            f"{len(bundle.train)} images with data.drop_last=true: lower it or set drop_last=false"
        )
    batch_size = train_plan.kwargs["batch_size"]
    if settings.mode == Mode.compute:  # the compute ceiling: no loader at all, one batch already on the device
        # trainer.max_steps steps in one pass: the dataset's size does not cut a ceiling measurement short
        train_loader = DeviceBatches.random(bundle, batch_size, settings.trainer.max_steps or len(train_loader), device)
    elif train_plan.device_resident:
        train_loader = build_resident(
            bundle,
            train_sampler(len(bundle.train), train_plan, seed=seed, **shard),
            batch_size,
            drop_last=train_plan.kwargs["drop_last"],
            device=device,
            workers=train_plan.kwargs["num_workers"],
            augment=settings.dataset.augment,
        )
    feed = Feed.build(
        bundle,
        device,
        memory_format,
        pinned=train_plan.kwargs["pin_memory"],
        prefetch=train_plan.prefetch_to_device and settings.mode != Mode.compute,
        gpu_decode=gpu_decode,
        timed=settings.data.stage_timings,
    )
    data = RunData(bundle, train_loader, val_loader, loader_args, feed, settings.data)
    save_loader_args(data, info, out_dir)
    return data
