"""The input pipeline of a run: the dataset, the effective DataLoader arguments, and the two loaders."""

from __future__ import annotations

import logging
from pathlib import Path

import torch
from hydra.utils import instantiate
from omegaconf import DictConfig

from imgtrain import dist, report
from imgtrain.config import Config, ConfigError
from imgtrain.device_data import build_resident
from imgtrain.loader import LoaderPlan, build_loader, plan_loader, train_sampler
from imgtrain.step import DeviceBatches

log = logging.getLogger(__name__)


def plan_loaders(settings: Config, device: torch.device, info: dist.DistInfo) -> tuple[LoaderPlan, LoaderPlan]:
    common = {
        "device_type": device.type,
        "world_size": info.world_size,
        "local_world_size": info.local_world_size,
    }
    train_plan = plan_loader(settings.data, train=True, **common)
    val_plan = plan_loader(settings.data, train=False, **common)
    for note in train_plan.notes:
        log.warning(note) if note.startswith("data.num_workers=0") else log.info(note)
    log.info("DataLoader (train): %s", report.format_args(train_plan.describe()))
    log.info("DataLoader (val):   %s", report.format_args(val_plan.describe()))
    return train_plan, val_plan


def build_data(cfg: DictConfig, settings: Config, info: dist.DistInfo, device: torch.device, out_dir: Path):
    """Dataset, train and val loaders, and the effective loader arguments (logged, and saved by rank 0)."""
    seed = settings.trainer.seed
    with dist.main_process_first(info):  # rank 0 generates `shapes` once; the others then reuse its files
        bundle = instantiate(cfg.dataset, _convert_="all")
    log.info(
        "dataset %s: %d train / %d val images, %d classes, %d px",
        *(bundle.name, len(bundle.train), len(bundle.val), bundle.num_classes, bundle.image_size),
    )
    gpu_decode = getattr(settings.dataset, "decode", "cpu") == "cuda"
    if gpu_decode and device.type != "cuda":
        raise ConfigError(
            f"dataset.decode=cuda needs a CUDA device, and this run uses {device}: use dataset.decode=cpu"
        )
    if gpu_decode and settings.data.device_resident:
        raise ConfigError("dataset.decode=cuda and data.device_resident=true do not combine: choose one")
    train_plan, val_plan = plan_loaders(settings, device, info)
    loader_args = {"train": train_plan.describe(), "val": val_plan.describe()}
    if info.is_main:
        report.write_json(out_dir / "loader_args.json", loader_args)
    shard = {"rank": info.rank, "world_size": info.world_size}
    train_loader = build_loader(bundle.train, train_plan, train=True, seed=seed, **shard)
    val_loader = build_loader(bundle.val, val_plan, train=False, seed=seed, **shard)
    if len(train_loader) == 0:
        raise ConfigError(
            f"data.batch_size={settings.data.batch_size} is larger than the training split of "
            f"{len(bundle.train)} images with data.drop_last=true: lower it or set drop_last=false"
        )
    if settings.mode == "compute":  # the compute ceiling: no loader at all, one batch already on the device
        # trainer.max_steps steps in one pass: the dataset's size does not cut a ceiling measurement short
        length = settings.trainer.max_steps or len(train_loader)
        train_loader = DeviceBatches.random(bundle, train_plan.kwargs["batch_size"], length, device)
    elif train_plan.device_resident:
        sampler = train_sampler(len(bundle.train), train_plan, seed=seed, **shard)
        train_loader = build_resident(
            bundle,
            sampler,
            train_plan.kwargs["batch_size"],
            train_plan.kwargs["drop_last"],
            device=device,
            workers=train_plan.kwargs["num_workers"],
            augment=settings.dataset.augment,
        )
    return bundle, train_loader, val_loader, loader_args
