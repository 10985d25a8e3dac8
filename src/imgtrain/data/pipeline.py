"""The input pipeline of a run: the dataset, the effective DataLoader arguments, the loaders and the feed."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from hydra.utils import instantiate
from torch.utils.data import DataLoader

from imgtrain.common.atomic import write_json
from imgtrain.common.errors import ConfigError
from imgtrain.config.datasets import AugmentPolicy, Decode
from imgtrain.config.schema import Config, DataConfig, Mode
from imgtrain.data.datasets import DatasetBundle
from imgtrain.data.failures import stop_workers
from imgtrain.data.feed import DeviceBatches, Feed, build_resident
from imgtrain.data.loader import LoaderPlan, build_loader, plan_loader, resolve_workers, train_sampler
from imgtrain.data.samplers import EpochSampler
from imgtrain.data.streamed import StreamedLoader, StreamedSplit
from imgtrain.host import dist, optional

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
    planner: Planner  # the one route to a loader plan: num_workers=tune plans its probes and its choice with it
    left_out: tuple[tuple[str, str], ...] = ()  # data.device_resident: unreadable training files, (path, reason)

    @property
    def replicas(self) -> int:
        """Ranks the training order is sharded over (1 when each rank reads the whole set)."""
        if isinstance(self.train, StreamedLoader):
            return self.train.replicas
        sampler = getattr(self.train, "sampler", None)
        return sampler.num_replicas if isinstance(sampler, EpochSampler) else 1

    @property
    def order(self) -> StreamedLoader | None:
        """The training order's state that checkpoints must keep (dataset=shards), if any."""
        return self.train if isinstance(self.train, StreamedLoader) else None

    def close(self) -> None:
        """Stop both loaders' persistent workers now, politely. Left to interpreter exit (after an error, whose
        traceback keeps the loaders alive), multiprocessing would SIGTERM them, which they outlive for
        WORKER_GRACE_S (see loader.worker_signals): the run would take 30 s to end."""
        for loader in (self.train, self.val):
            if isinstance(loader, StreamedLoader):
                loader.close()
            stop_workers(getattr(loader, "_iterator", None))

    def start_epoch(self, epoch: int, samples_done: int) -> None:
        """Set the epoch's order (the same on every rank), skipping the samples a resumed epoch already had."""
        if isinstance(self.train, StreamedLoader):
            self.train.start_epoch(epoch, samples_done)
            return
        sampler = getattr(self.train, "sampler", None)
        if isinstance(sampler, EpochSampler):
            sampler.set_epoch(epoch, start=samples_done // self.replicas)
        out_of_order = isinstance(self.train, DataLoader) and getattr(self.train, "in_order", True) is False
        if samples_done and out_of_order and self.train.num_workers:  # resuming by position: see DataConfig.in_order
            log.warning(
                "data.in_order=false: this resumed epoch skips the first %d samples of its order, but the steps before "
                "the checkpoint took batches out of order: up to num_workers x prefetch_factor batches of it are "
                "repeated, and as many skipped",
                samples_done,
            )


def make_loader(
    dataset: Any,
    plan: LoaderPlan,
    *,
    train: bool,
    seed: int,
    rank: int = 0,
    world_size: int = 1,
    replan: Callable[[int], LoaderPlan] | None = None,
) -> Any:
    """The split's loader: LitData's for dataset=shards (`replan(workers)`: the plan with another worker count, to
    finish a resumed epoch with the count it started with), else a DataLoader with our samplers."""
    if isinstance(dataset, StreamedSplit):
        return dataset.make_loader(plan, train=train, seed=seed, rank=rank, world_size=world_size, replan=replan)
    return build_loader(dataset, plan, train=train, seed=seed, rank=rank, world_size=world_size)


@dataclass(frozen=True)
class Planner:
    """The one route from the config to a loader plan, made once per run (`for_run`): the training plan for any
    worker count (data.num_workers, the count the ranks agreed on, num_workers=tune's probes and its choice, the
    count a resumed shards epoch started with) and the validation plan, by the same function."""

    data: DataConfig  # data.*
    train_data: DataConfig  # data.*, with what dataset=shards' training loader cannot follow set aside (`_streamed`)
    device_type: str
    info: dist.DistInfo
    streamed: bool = False  # dataset=shards: LitData's loader

    @classmethod
    def for_run(cls, data: DataConfig, device_type: str, info: dist.DistInfo, streamed: bool = False) -> Planner:
        return cls(data, _streamed(data, info) if streamed else data, device_type, info, streamed)

    def train(self, workers: int | None = None) -> LoaderPlan:
        """The training loader's plan; `workers` in place of data.num_workers."""
        return plan_loader(self.train_data, train=True, workers=workers, **self._placement())

    def val(self) -> LoaderPlan:
        return plan_loader(self.data, train=False, **self._placement())

    def agreed_workers(self) -> int | None:
        """dataset=shards under DDP: LitData deals chunks to world_size x num_workers workers, so every rank takes
        rank 0's count (one broadcast, when the loaders are built); None where each rank's own count stands."""
        if not self.streamed or self.info.world_size == 1:
            return None
        own, _ = resolve_workers(self.train_data, self.info.local_world_size)
        workers = dist.broadcast_plain(own, self.info)
        if workers == own:
            return None
        log.warning("dataset=shards: data.num_workers=%d on every rank, rank 0's (LitData needs one count)", workers)
        return workers

    def _placement(self) -> dict[str, Any]:
        """What plan_loader needs to know of where it runs."""
        info = self.info
        return {
            "device_type": self.device_type,
            "world_size": info.world_size,
            "local_world_size": info.local_world_size,
            "process_group": info.enabled,
        }


def use_tuned_workers(data: RunData, seed: int, tuned: dict) -> None:
    """Rebuild the training loader with the count `data.num_workers=tune` chose, and record the probe with its
    arguments (loader_args.json is written again by `save_loader_args`)."""
    info = data.planner.info
    if data.planner.streamed:  # one count on every rank (see Planner.agreed_workers)
        tuned["chosen"] = dist.broadcast_plain(tuned["chosen"], info)
    plan = data.planner.train(tuned["chosen"])
    shard = {"rank": info.rank, "world_size": info.world_size}
    data.train = make_loader(data.bundle.train, plan, train=True, seed=seed, replan=data.planner.train, **shard)
    data.loader_args["train"] = plan.describe()
    data.loader_args["tune"] = tuned


def save_loader_args(data: RunData, info: dist.DistInfo, out_dir: Path) -> None:
    """The effective loader arguments (and the tune probe, when one ran), by rank 0."""
    if info.is_main:
        write_json(out_dir / "loader_args.json", data.loader_args)


def _format(args: dict[str, Any]) -> str:
    return " ".join(f"{k}={v}" for k, v in args.items())


def _log_plans(train_plan: LoaderPlan, loader_args: dict[str, dict[str, Any]]) -> None:
    for note in train_plan.notes:
        log.warning(note) if note.startswith("data.num_workers=0") else log.info(note)
    log.info("DataLoader (train): %s", _format(loader_args["train"]))
    log.info("DataLoader (val):   %s", _format(loader_args["val"]))


def decodes_on_gpu(settings: Config, device: torch.device) -> bool:
    """Whether the feed decodes JPEG batches on the GPU (dataset.decode=cuda); refuses what cannot run. The
    compute ceiling (mode=compute) trains on one random batch already on the device: nothing to decode."""
    gpu_decode = getattr(settings.dataset, "decode", Decode.cpu) == Decode.cuda
    if gpu_decode and device.type != "cuda":
        raise ConfigError(
            f"dataset.decode=cuda needs a CUDA device, and this run uses {device}: use dataset.decode=cpu"
        )
    if gpu_decode and settings.data.device_resident:
        raise ConfigError("dataset.decode=cuda and data.device_resident=true do not combine: choose one")
    return gpu_decode and settings.mode != Mode.compute


def _streamed(data: DataConfig, info: dist.DistInfo) -> DataConfig:
    """dataset=shards: data.* as LitData's training loader can follow it, each adjustment said in one line (once per
    run); validation keeps data.* as it is (it has no resume state)."""
    if data.device_resident:
        raise ConfigError(
            "data.device_resident=true needs the whole training set in memory at once, and dataset=shards streams "
            "it: use data.device_resident=false, or dataset=imagefolder on a local copy"
        )
    if not data.in_order:
        log.warning("data.in_order=false does not apply to dataset=shards: LitData's resume state needs worker order")
    if info.world_size > 1 and data.distributed_sampler is False:
        log.warning("data.distributed_sampler=false does not apply to dataset=shards: LitData shards over the ranks")
    if info.world_size > 1 and not data.drop_last:
        log.warning(
            "data.drop_last=false does not apply to dataset=shards under DDP: LitData does not pad the ranks' "
            "shares, so without dropping the last incomplete batch they would take different numbers of steps"
        )
    return dataclasses.replace(data, in_order=True, drop_last=data.drop_last or info.world_size > 1)


def _no_batch(batch_size: int, train: Any, world_size: int) -> str:
    """Why the training loader has no batch: the split is smaller than one batch (per rank, for a streamed split,
    which LitData deals to the ranks in whole batches only: its `len()` is then 0, the stored count `samples`)."""
    if not isinstance(train, StreamedSplit):
        return (
            f"data.batch_size={batch_size} is larger than the training split of {len(train)} images with "
            "data.drop_last=true: lower it or set drop_last=false"
        )
    if world_size > 1:  # drop_last=false would give the whole remainder to the last rank: unequal step counts
        return (
            f"data.batch_size={batch_size} x {world_size} ranks is more than the training split of {train.samples} "
            "images: LitData gives each rank whole batches only: lower data.batch_size"
        )
    return (
        f"data.batch_size={batch_size} is larger than the training split of {train.samples} images, and LitData "
        "gives whole batches only with data.drop_last=true: lower it or set drop_last=false"
    )


def build_data(
    settings: Config, info: dist.DistInfo, device: torch.device, memory_format: torch.memory_format, out_dir: Path
) -> RunData:
    """Dataset, loaders and feed; the effective loader arguments are logged, and saved by rank 0."""
    seed = settings.train.seed
    if settings.dataset.extra is not None:  # e.g. dataset=shards: LitData and boto3, one line if either is missing
        optional.require_extra(settings.dataset.extra, f"dataset={settings.dataset.name}")
    with dist.main_process_first(info):  # rank 0 generates `shapes` once; the others then reuse its files
        bundle = instantiate(settings.dataset, _convert_="all")
    log.info(
        "dataset %s: %d train / %d val images, %d classes, %d px",
        *(bundle.name, len(bundle.train), len(bundle.val), bundle.num_classes, bundle.image_size),
    )
    gpu_decode = decodes_on_gpu(settings, device)
    planner = Planner.for_run(settings.data, device.type, info, streamed=isinstance(bundle.train, StreamedSplit))
    train_plan, val_plan = planner.train(planner.agreed_workers()), planner.val()
    loader_args = {"train": train_plan.describe(), "val": val_plan.describe()}
    _log_plans(train_plan, loader_args)
    shard = {"rank": info.rank, "world_size": info.world_size}
    train_loader = make_loader(bundle.train, train_plan, train=True, seed=seed, replan=planner.train, **shard)
    val_loader = make_loader(bundle.val, val_plan, train=False, seed=seed, **shard)
    if len(train_loader) == 0:
        raise ConfigError(_no_batch(settings.data.batch_size, bundle.train, info.world_size))
    batch_size = train_plan.kwargs["batch_size"]
    left_out: tuple[tuple[str, str], ...] = ()  # unreadable files a device-resident training set left out
    if settings.mode == Mode.compute:  # the compute ceiling: no loader at all, one batch already on the device
        # train.max_steps steps in one pass: the dataset's size does not cut a ceiling measurement short
        train_loader = DeviceBatches.random(bundle, batch_size, settings.train.max_steps or len(train_loader), device)
    elif train_plan.device_resident:
        train_loader, left_out = build_resident(
            bundle,
            lambda count: train_sampler(count, train_plan, seed=seed, **shard),
            batch_size,
            drop_last=train_plan.kwargs["drop_last"],
            device=device,
            workers=train_plan.kwargs["num_workers"],
            start_method=train_plan.kwargs.get("multiprocessing_context"),
            augment=settings.dataset.augment != AugmentPolicy.none,  # crop and flip (validate refuses a policy)
            max_bad_samples=settings.data.max_bad_samples,
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
    data = RunData(bundle, train_loader, val_loader, loader_args, feed, settings.data, planner, left_out)
    save_loader_args(data, info, out_dir)
    return data
