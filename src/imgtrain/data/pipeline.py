"""The input pipeline of a run: the dataset, the effective DataLoader arguments, the loaders and the feed.

One route from the config to a loader, for every split and for num_workers=tune's probes: a `LoaderPlan`
(`RunData.train_plan`, `RunData.val_plan`: loader.plan_loader), then `build_loader`, which builds the loader of a
plan (a DataLoader; a streamed split's engine builds its own). `build_data` builds the run's `RunData`; with
data.num_workers=tune its training loader waits for the probe's count (`RunData.build_train`), so it is built once.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from hydra.utils import instantiate
from torch.utils.data import DataLoader

from imgtrain.common.atomic import write_json
from imgtrain.common.errors import ConfigError
from imgtrain.config.data import DataConfig, LoaderEngine
from imgtrain.config.datasets import AugmentPolicy, Decode, GpuDecoder
from imgtrain.config.fields import TUNE
from imgtrain.config.schema import Config, Mode
from imgtrain.data.datasets import DatasetBundle
from imgtrain.data.failures import stop_workers
from imgtrain.data.feed import DeviceBatches, Feed, build_resident
from imgtrain.data.loader import LoaderPlan, plan_loader, resolve_workers, train_sampler
from imgtrain.data.region_probe import import_codec
from imgtrain.data.samplers import EpochSampler, ShardSampler
from imgtrain.data.samples import GuardedSamples, collate
from imgtrain.data.slices import SlicedLoader, sliced_args
from imgtrain.data.streamed import StreamedLoader, StreamedSplit
from imgtrain.data.threads import ThreadLoader
from imgtrain.host import dist, optional

log = logging.getLogger(__name__)


@dataclass
class RunData:
    """Everything the loop reads from: the dataset, its two loaders, and how batches reach the device; and the one
    route to the training plan for any worker count (data.num_workers, the count the ranks agreed on,
    num_workers=tune's probes and its choice, the count a resumed shards epoch started with)."""

    bundle: DatasetBundle
    settings: DataConfig  # data.*: what the failure explanations name
    info: dist.DistInfo
    device_type: str
    seed: int  # train.seed
    streamed: bool = False  # dataset=shards: LitData's loader
    gpu_decode: bool = False  # dataset.decode=cuda: `auto` leaves its decode thread a core
    # a DataLoader, a StreamedLoader (dataset=shards), a ResidentLoader (data.device_resident) or DeviceBatches
    # (mode=compute); None until num_workers=tune's probe chose the count (`build_train`)
    train: Any = None
    val: Any = None
    loader_args: dict[str, dict[str, Any]] = field(default_factory=dict)  # the effective arguments, per split
    feed: Feed | None = None
    left_out: tuple[tuple[str, str], ...] = ()  # data.device_resident: unreadable training files, (path, reason)
    # data.*, with what dataset=shards' training loader cannot follow set aside (`_streamed`, said once per run)
    train_settings: DataConfig = field(init=False)

    def __post_init__(self) -> None:
        self.train_settings = _streamed(self.settings, self.info) if self.streamed else self.settings

    def train_plan(self, workers: int | None = None, engine: LoaderEngine | None = None) -> LoaderPlan:
        """The training loader's plan; `workers` and `engine` in place of data.num_workers and data.engine."""
        return plan_loader(self.train_settings, train=True, workers=workers, engine=engine, **self._placement())

    def val_plan(self) -> LoaderPlan:
        return plan_loader(self.settings, train=False, **self._placement())

    def agreed_workers(self) -> int | None:
        """dataset=shards under DDP: LitData deals chunks to world_size x num_workers workers, so every rank takes
        rank 0's count (one broadcast, when the loaders are built); None where each rank's own count stands."""
        if not self.streamed or self.info.world_size == 1:
            return None
        own, _ = resolve_workers(self.train_settings, self.info.local_world_size, self.device_type, self.gpu_decode)
        workers = dist.broadcast_plain(own, self.info)
        if workers == own:
            return None
        log.warning("dataset=shards: data.num_workers=%d on every rank, rank 0's (LitData needs one count)", workers)
        return workers

    def build_train(self, workers: int, tuned: dict[str, Any] | None = None) -> None:
        """data.num_workers=tune: build the training loader, once, with the count (and, with data.engine=tune, the
        engine) its probe chose (`tuned`, recorded with the loader arguments) or, when the probe failed, with the
        count planned before it. dataset=shards: rank 0's count on every rank (LitData needs one)."""
        if self.streamed:
            workers = dist.broadcast_plain(workers, self.info)
        engine = LoaderEngine(tuned["engine"]) if tuned and tuned.get("engine") else None
        plan = self.train_plan(workers, engine)
        shard = {"rank": self.info.rank, "world_size": self.info.world_size}
        self.train = build_loader(self.bundle.train, plan, train=True, seed=self.seed, replan=self.train_plan, **shard)
        check_batches(self.train, self.bundle.train, plan.kwargs["batch_size"], self.info.world_size)
        self.loader_args["train"] = plan.describe()
        if tuned is not None:
            self.loader_args["tune"] = tuned | {"chosen": workers}

    def _placement(self) -> dict[str, Any]:
        """What plan_loader needs to know of where it runs."""
        info = self.info
        return {
            "device_type": self.device_type,
            "world_size": info.world_size,
            "local_world_size": info.local_world_size,
            "process_group": info.enabled,
            "gpu_decode": self.gpu_decode,
        }

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
            if isinstance(loader, StreamedLoader | ThreadLoader):
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


def build_loader(
    dataset: Any,
    plan: LoaderPlan,
    *,
    train: bool,
    seed: int,
    rank: int = 0,
    world_size: int = 1,
    replan: Callable[[int], LoaderPlan] | None = None,
) -> Any:
    """The loader of `plan`: a DataLoader whose training split gets an EpochSampler (sharded under DDP), or with
    data.engine=threads a ThreadLoader over the same sampler and samples (data/threads.py); for a
    streamed split (dataset=shards), its engine's loader (`replan(workers)`: the plan with another worker count, to
    finish a resumed epoch with the count it started with)."""
    if isinstance(dataset, StreamedSplit):
        return dataset.build_loader(plan, train=train, seed=seed, rank=rank, world_size=world_size, replan=replan)
    kwargs = dict(plan.kwargs)
    kwargs.pop("shuffle")  # the samplers shuffle
    generator = torch.Generator()
    generator.manual_seed(seed + rank)  # the workers' base seed (Python and NumPy in init_worker)
    if train:
        kwargs["sampler"] = train_sampler(len(dataset), plan, seed=seed, rank=rank, world_size=world_size)
    elif world_size > 1:
        kwargs["sampler"] = ShardSampler(len(dataset), rank, world_size)
    samples = GuardedSamples(
        dataset, replace=train, timed=plan.stage_timings, augment_on=plan.augment_on, seeded_loads=not plan.threads
    )
    if plan.slices > 1:  # each worker makes a slice of a step's batch; the slices are joined on the device
        loader = DataLoader(samples, generator=generator, collate_fn=collate, **sliced_args(kwargs, plan.slices))
        return SlicedLoader(loader, plan.slices, drop_last=kwargs["drop_last"])
    if plan.threads:
        return ThreadLoader(samples, kwargs["sampler"], batch_size=kwargs["batch_size"], drop_last=kwargs["drop_last"],
                            threads=kwargs["num_workers"], in_order=kwargs.get("in_order", True),
                            pin_memory=kwargs["pin_memory"], timeout=kwargs["timeout"])  # fmt: skip
    return DataLoader(samples, generator=generator, collate_fn=collate, **kwargs)


def check_batches(loader: Any, dataset: Any, batch_size: int, world_size: int) -> None:
    """Refuse (one line) a training loader with no batch: the split is smaller than one batch (per rank, for a
    streamed split, which LitData deals to the ranks in whole batches only: its `len()` is then 0, the stored count
    `samples`)."""
    if len(loader) > 0:
        return
    if not isinstance(dataset, StreamedSplit):
        raise ConfigError(
            f"data.batch_size={batch_size} is larger than the training split of {len(dataset)} images with "
            "data.drop_last=true: lower it or set drop_last=false"
        )
    if world_size > 1:  # drop_last=false would give the whole remainder to the last rank: unequal step counts
        raise ConfigError(
            f"data.batch_size={batch_size} x {world_size} ranks is more than the training split of {dataset.samples} "
            "images: LitData gives each rank whole batches only: lower data.batch_size"
        )
    raise ConfigError(
        f"data.batch_size={batch_size} is larger than the training split of {dataset.samples} images, and LitData "
        "gives whole batches only with data.drop_last=true: lower it or set drop_last=false"
    )


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
    if gpu_decode and settings.mode != Mode.compute and gpu_decoder(settings) == GpuDecoder.nvimgcodec:
        import_codec()  # the gpu-decode extra: one line before any batch if it is missing
    return gpu_decode and settings.mode != Mode.compute


def gpu_decoder(settings: Config) -> GpuDecoder:
    """dataset.gpu_decoder, where the dataset has one (those with dataset.decode)."""
    return getattr(settings.dataset, "gpu_decoder", GpuDecoder.torchvision)


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


def _open_dataset(settings: Config, info: dist.DistInfo) -> DatasetBundle:
    """The dataset the config names, generated or opened once (rank 0 first), said in one line."""
    if settings.dataset.extra is not None:  # e.g. dataset=shards: LitData and boto3, one line if either is missing
        optional.require_extra(settings.dataset.extra, f"dataset={settings.dataset.name}")
    if settings.data.engine == LoaderEngine.threads:  # torchdata, before the dataset is generated or scanned
        optional.require_extra("threads", "data.engine=threads")
    with dist.main_process_first(info):  # rank 0 generates `shapes` once; the others then reuse its files
        bundle = instantiate(settings.dataset, _convert_="all")
    log.info(
        "dataset %s: %d train / %d val images, %d classes, %d px",
        *(bundle.name, len(bundle.train), len(bundle.val), bundle.num_classes, bundle.image_size),
    )
    return bundle


def build_data(
    settings: Config, info: dist.DistInfo, device: torch.device, memory_format: torch.memory_format, out_dir: Path
) -> RunData:
    """Dataset, loaders and feed; the effective loader arguments are logged, and saved by rank 0. The training
    loader: mode=compute's batch on the device, data.device_resident's training set on the device, else the plan's
    loader; with data.num_workers=tune in mode=train, none yet: the probe builds it with its count (build_train)."""
    seed, bundle = settings.train.seed, _open_dataset(settings, info)
    gpu_decode = decodes_on_gpu(settings, device)
    streamed = isinstance(bundle.train, StreamedSplit)
    data = RunData(bundle, settings.data, info, device.type, seed, streamed=streamed, gpu_decode=gpu_decode)
    train_plan, val_plan = data.train_plan(data.agreed_workers()), data.val_plan()
    data.loader_args = {"train": train_plan.describe(), "val": val_plan.describe()}
    _log_plans(train_plan, data.loader_args)
    shard = {"rank": info.rank, "world_size": info.world_size}
    batch_size = train_plan.kwargs["batch_size"]
    resident = train_plan.device_resident and settings.mode != Mode.compute
    tuned = settings.data.num_workers == TUNE and settings.mode == Mode.train and not resident
    if not (resident or tuned):
        data.train = build_loader(bundle.train, train_plan, train=True, seed=seed, replan=data.train_plan, **shard)
    data.val = build_loader(bundle.val, val_plan, train=False, seed=seed, **shard)
    if resident:  # the training set decoded once onto the device: one DataLoader pass, no training DataLoader
        data.train, data.left_out = build_resident(
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
    if data.train is not None:
        check_batches(data.train, bundle.train, batch_size, info.world_size)
    if settings.mode == Mode.compute:  # the compute ceiling: no loader at all, one batch already on the device
        # train.max_steps steps in one pass: the dataset's size does not cut a ceiling measurement short
        data.train = DeviceBatches.random(bundle, batch_size, settings.train.max_steps or len(data.train), device)
    data.feed = Feed.build(
        bundle,
        device,
        memory_format,
        pinned=train_plan.kwargs["pin_memory"],
        prefetch=train_plan.prefetch_to_device and settings.mode != Mode.compute,
        gpu_decode=gpu_decode,
        timed=settings.data.stage_timings,
        gpu_decoder=gpu_decoder(settings),
    )
    save_loader_args(data, info, out_dir)
    return data
