"""Typed config schemas (dataclasses in Hydra's ConfigStore): the one place every default is set.

OmegaConf enforces the types and the Enum choices at composition time, so `data.batch_size=abc` and
`trainer.precision=fp8` fail before `run` starts, naming the key and the accepted values. Range checks sit
next to their fields (`_check`); `validate` runs them and the few checks that span fields, once, and returns
the config as these dataclasses. The YAML files in conf/ only choose between schemas and set what differs.
"""

from __future__ import annotations

import multiprocessing
import os
from collections.abc import Callable
from dataclasses import dataclass, field, fields, is_dataclass
from enum import Enum
from typing import Any

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, DictConfig, OmegaConf

from imgtrain.errors import ConfigError

AUTO = "auto"
TUNE = "tune"  # data.num_workers=tune: probe the loader at a few worker counts before training
IMAGENET_MEAN = [0.485, 0.456, 0.406]
IMAGENET_STD = [0.229, 0.224, 0.225]


class Choice(str, Enum):
    """A config choice: OmegaConf checks it and lists the options; it compares and prints as its name."""

    def __str__(self) -> str:
        return self.value

    def __format__(self, spec: str) -> str:
        return format(self.value, spec)


class Device(Choice):
    auto = "auto"  # cuda when available
    cpu = "cpu"
    cuda = "cuda"


class Precision(Choice):
    auto = "auto"  # bf16 on GPUs with native bf16 (compute capability 8.0+), else fp32
    fp32 = "fp32"
    bf16 = "bf16"
    fp16 = "fp16"  # adds a GradScaler


class Mode(Choice):
    train = "train"
    loader = "loader"  # the input pipeline and the copy, with a model that does nothing: its ceiling
    compute = "compute"  # the model on one batch already on the device: the compute ceiling


class NonFinite(Choice):
    stop = "stop"  # keep the last good checkpoint and stop
    skip = "skip"  # skip the update (counted); reads the loss every step


class Decode(Choice):
    cpu = "cpu"  # workers decode
    cuda = "cuda"  # workers read bytes; the GPU decodes whole batches (nvJPEG)


class StartMethod(Choice):
    fork = "fork"
    spawn = "spawn"
    forkserver = "forkserver"


class Arch(Choice):
    resnet18 = "resnet18"
    resnet34 = "resnet34"
    resnet50 = "resnet50"


class Metric(Choice):
    """Keys of metrics.json that `run` can return to a sweeper."""

    val_acc = "val_acc"
    best_val_acc = "best_val_acc"
    val_loss = "val_loss"
    images_per_sec = "images_per_sec"
    data_wait_frac = "data_wait_frac"
    step_time_ms = "step_time_ms"


# ----------------------------------------------------------------------------- range checks, next to fields
Check = Callable[[Any], str | None]  # None when the value is fine, else what is accepted


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def at_least(low: float, what: str = "an integer", note: str = "", null: str | None = None) -> Check:
    """`value >= low`; `null`, when given, says what null means (and allows it)."""

    def check(value: Any) -> str | None:
        if value is None and null is not None:
            return None
        if value is None or value < low:
            allowed = f"null{f' ({null})' if null else ''} or " if null is not None else ""
            return f"expected {allowed}{what} >= {low:g}{f' ({note})' if note else ''}"
        return None

    return check


def auto_or_bool(value: Any) -> str | None:
    return None if value == AUTO or isinstance(value, bool) else "accepted values are auto, true, false"


def _checked(default: Any, check: Check) -> Any:
    """A field with its default and its range check (run by `validate`)."""
    if isinstance(default, list):
        return field(default_factory=lambda: list(default), metadata={"check": check})
    return field(default=default, metadata={"check": check})


# ----------------------------------------------------------------------------- data (the DataLoader)
def _workers(value: Any) -> str | None:
    ok = value in (AUTO, TUNE) or (_is_int(value) and value >= 0)
    return None if ok else "expected an integer >= 0, auto or tune"


@dataclass
class DataConfig:
    """Every DataLoader knob. Each one is overridable as data.<key>=..."""

    batch_size: int = _checked(64, at_least(1, note="images per process"))  # global: x world_size
    num_workers: Any = _checked(AUTO, _workers)  # auto: CPUs of this process / local world size, minus one
    # num_workers=tune: before training, probe the loader at a few worker counts (this many seconds in all,
    # with the compute probe) and keep the fewest workers that stay 1.25x ahead of the model
    tune_budget_s: float = _checked(20.0, lambda v: None if v >= 2 else "expected seconds >= 2")
    pin_memory: bool = True  # page-locked host buffers; only meaningful with CUDA (turned off on CPU)
    prefetch_factor: int | None = _checked(2, at_least(1, null=""))  # batches ahead per worker
    persistent_workers: bool = True  # keep workers alive across epochs instead of re-forking them
    drop_last: bool = True  # training only: avoids a tiny last batch (noisy BatchNorm, uneven DDP ranks)
    shuffle: bool = True  # training only; under DDP the DistributedSampler shuffles instead
    distributed_sampler: Any = _checked(AUTO, auto_or_bool)  # auto: on under DDP
    multiprocessing_context: StartMethod | None = None  # null: the platform's default
    timeout: float = _checked(0.0, at_least(0, "seconds", note="0 waits forever"))  # for a batch from a worker
    seed_workers: bool = True  # seed python/numpy/torch in each worker so augmentation is reproducible
    val_batch_size: int | None = _checked(None, at_least(1, null=""))  # null: 2 x batch_size
    device_resident: bool = False  # whole training set as one uint8 tensor on the device, batched crop/flip there
    prefetch_to_device: bool = True  # on CUDA with pin_memory: copy the next batch on a side stream
    max_bad_samples: int | None = _checked(100, at_least(0, null="no limit"))
    stage_timings: bool = True  # time read/decode/augment/collate in the workers, transfer and copy in the loop


# ----------------------------------------------------------------------------- datasets
@dataclass
class DatasetConfig:
    """Fields every dataset has. `_target_` is the builder that `hydra.utils.instantiate` calls."""

    _target_: str = MISSING
    name: str = MISSING
    image_size: int = _checked(64, at_least(8, note="pixels"))  # side of the square training crop
    mean: list[float] = field(default_factory=lambda: list(IMAGENET_MEAN))  # 0..1 units, applied on the device
    std: list[float] = field(default_factory=lambda: list(IMAGENET_STD))
    augment: bool = True


@dataclass
class ShapesConfig(DatasetConfig):
    """Procedurally drawn shapes, generated once as JPEG files in an ImageFolder layout."""

    _target_: str = "imgtrain.data.datasets.build_shapes"
    name: str = "shapes"
    image_size: int = _checked(32, at_least(8, note="pixels"))
    root: str = "${data_dir}/shapes"
    num_train: int = _checked(5000, at_least(1))
    num_val: int = _checked(1000, at_least(1))
    seed: int = 0
    mean: list[float] = field(default_factory=lambda: [0.5, 0.5, 0.5])
    std: list[float] = field(default_factory=lambda: [0.25, 0.25, 0.25])


@dataclass
class SyntheticConfig(DatasetConfig):
    """Random uint8 images held in memory: no decode cost, for compute-bound measurements."""

    _target_: str = "imgtrain.data.datasets.build_synthetic"
    name: str = "synthetic"
    num_train: int = _checked(4096, at_least(1))
    num_val: int = _checked(512, at_least(1))
    num_classes: int = _checked(10, at_least(1))
    seed: int = 0


def _fraction(value: float) -> str | None:
    return None if 0.0 < value < 1.0 else "expected a fraction between 0 and 1"


@dataclass
class ImageFolderConfig(DatasetConfig):
    """Any ImageNet-style folder: root/train/<class>/*, root/val/<class>/*, or root/<class>/* plus a split."""

    _target_: str = "imgtrain.data.datasets.build_imagefolder"
    name: str = "imagefolder"
    root: str | None = None  # required
    val_fraction: float = _checked(0.1, _fraction)  # used only when root has no val/ folder
    split_seed: int = 0
    image_size: int = _checked(224, at_least(8, note="pixels"))
    val_resize: int | None = None  # null = image_size / 0.875, the usual ImageNet ratio
    decode: Decode = Decode.cpu


@dataclass
class ShardsConfig(DatasetConfig):
    """An image folder packed by `imgtrain-shards SRC DST` (LitData shards), streamed from a directory or from
    S3-compatible object storage (s3://bucket/prefix; credentials and endpoint from the standard AWS variables)."""

    _target_: str = "imgtrain.data.shards.dataset.build_shards"
    name: str = "shards"
    root: str | None = None  # required: the DST that imgtrain-shards wrote, a directory or s3://bucket/prefix
    image_size: int = _checked(224, at_least(8, note="pixels"))
    val_resize: int | None = None  # null = image_size / 0.875, the usual ImageNet ratio
    decode: Decode = Decode.cpu
    # Object storage only: LitData keeps the chunks it fetches under cache_dir/<bucket>/<prefix>/<split>, on each
    # node, shared by the ranks there; cache_limit_gb caps that (null: LitData's default, 75% of the free disk
    # leaving at least 50 GB). Below the split's size, each chunk is deleted after use and fetched again next epoch.
    cache_dir: str = "${data_dir}/shard-cache"
    cache_limit_gb: float | None = _checked(None, at_least(0.001, "GB", null="LitData's default"))
    timeout_s: float = _checked(10.0, lambda v: None if v > 0 else "expected seconds > 0")  # per request, 2 tries


@dataclass
class CifarConfig(DatasetConfig):
    """torchvision's CIFAR-10/100; downloaded on first use, with a clear message when offline."""

    _target_: str = "imgtrain.data.cifar.build_cifar"
    name: str = "cifar10"  # cifar10 or cifar100
    root: str = "${data_dir}/cifar"
    download: bool = True
    image_size: int = _checked(32, at_least(8, note="pixels"))
    mean: list[float] = field(default_factory=lambda: [0.4914, 0.4822, 0.4465])
    std: list[float] = field(default_factory=lambda: [0.2470, 0.2435, 0.2616])


# ----------------------------------------------------------------------------- model and optimizer
@dataclass
class ModelConfig:
    _target_: str = "imgtrain.model.build_model"
    arch: Arch = Arch.resnet18  # torchvision's ResNets
    cifar_stem: bool = False  # 3x3 stride-1 stem and no max-pool, for 32-px images
    zero_init_residual: bool = False


@dataclass
class SGDConfig:
    _target_: str = "torch.optim.SGD"
    lr: float = 0.1  # for the global batch; scale it with world_size x batch_size
    momentum: float = 0.9
    weight_decay: float = 5e-4  # not applied to BatchNorm weights and biases
    nesterov: bool = True


@dataclass
class AdamWConfig:
    _target_: str = "torch.optim.AdamW"
    lr: float = 2e-3
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    weight_decay: float = 0.05  # not applied to BatchNorm weights and biases


# ----------------------------------------------------------------------------- trainer
def _resume(value: str) -> str | None:
    if value in (AUTO, "none") or os.path.isfile(os.path.expanduser(value)):
        return None
    return "expected auto, none or the path of an existing checkpoint file"


_MINUTES = "expected minutes > 0, or null (save at every epoch end instead)"


@dataclass
class TrainerConfig:
    epochs: int = _checked(5, at_least(1))
    max_steps: int | None = _checked(None, at_least(1, null=""))  # stop after this many optimizer steps
    device: Device = Device.auto
    precision: Precision = Precision.auto
    channels_last: Any = _checked(AUTO, auto_or_bool)  # auto: on for CUDA
    compile: bool = False  # torch.compile the model
    seed: int = 0
    deterministic: bool = False  # deterministic algorithms, cuDNN autotuning off: bit-exact reruns, also on GPU
    warmup_steps: int = _checked(10, at_least(0))  # steps left out of throughput: start-up, first batches
    log_every_n_steps: int = _checked(20, at_least(1))  # when the loop reads the loss back and logs
    lr_warmup_epochs: float = _checked(0.5, at_least(0, "a number"))  # linear LR warmup, then cosine to zero
    label_smoothing: float = _checked(0.0, lambda v: None if 0.0 <= v < 1.0 else "expected a number in [0, 1)")
    progress_bar: Any = _checked(AUTO, auto_or_bool)  # auto: only on a terminal
    monitor_interval_s: float = _checked(0.5, lambda v: None if v > 0 else "expected seconds > 0")  # NVML/CPU/RSS
    dist_timeout_s: float = _checked(600.0, lambda v: None if v > 0 else "expected seconds > 0")  # collectives
    resume: str = _checked(AUTO, _resume)  # auto: the run directory's checkpoints/last.pt, if any; none; a path
    save_checkpoints: bool = True  # last.pt, last.prev.pt and best.pt under <run dir>/checkpoints (mode=train)
    # last.pt every this many minutes of wall time (rank 0's clock, checked at log windows), written in the
    # background; epoch ends save on the same clock (null: at every epoch end). Also saved: when validation
    # improves (best.pt), at the end of the run and on a stop signal.
    ckpt_every_min: float | None = _checked(10.0, lambda v: None if v is None or v > 0 else _MINUTES)
    ckpt_every_n_steps: int = _checked(0, at_least(0, note="0 = off"))  # also every this many steps
    nonfinite: NonFinite = NonFinite.stop  # a NaN/inf loss: stop, or skip the step (counted)
    # After training, time the model alone (a copy, on a batch already on the device) to tell CPU contention
    # from compute-bound. auto: only when workers and training may compete for the CPUs
    compute_probe: Any = _checked(AUTO, auto_or_bool)
    # A torch.profiler trace of profile_steps steps after warmup_steps (+1 profiler warm-up step), rank 0 only:
    # <run dir>/profile/trace_rank0.json.gz for https://ui.perfetto.dev, and the top operators as text.
    profile: bool = False
    profile_steps: int = _checked(5, at_least(1, note="steps recorded"))


@dataclass
class Config:
    dataset: DatasetConfig = MISSING
    model: ModelConfig = MISSING
    data: DataConfig = MISSING
    optim: Any = MISSING
    trainer: TrainerConfig = MISSING
    mode: Mode = Mode.train
    optimized_metric: Metric = Metric.val_acc  # what run() returns to a sweeper: a key of metrics.json
    data_dir: str = "${oc.env:IMGTRAIN_DATA_DIR,'~/.cache/imgtrain'}"
    output_dir: str = "${hydra:runtime.output_dir}"


def register_configs() -> None:
    """Store the schemas so the YAML files in conf/ can name them as their base (`- base_...`)."""
    cs = ConfigStore.instance()
    cs.store(name="base_config", node=Config)
    cs.store(group="data", name="base_data", node=DataConfig)
    cs.store(group="dataset", name="base_shapes", node=ShapesConfig)
    cs.store(group="dataset", name="base_synthetic", node=SyntheticConfig)
    cs.store(group="dataset", name="base_imagefolder", node=ImageFolderConfig)
    cs.store(group="dataset", name="base_cifar", node=CifarConfig)
    cs.store(group="dataset", name="base_shards", node=ShardsConfig)
    cs.store(group="model", name="base_model", node=ModelConfig)
    cs.store(group="optim", name="base_sgd", node=SGDConfig)
    cs.store(group="optim", name="base_adamw", node=AdamWConfig)
    cs.store(group="trainer", name="base_trainer", node=TrainerConfig)


# ----------------------------------------------------------------------------- validation
def _fail(key: str, value: Any, accepted: str) -> ConfigError:
    shown = "null" if value is None else str(value).lower() if isinstance(value, bool) else value
    return ConfigError(f"{key}={shown} is invalid: {accepted}")


def _check_fields(node: Any, prefix: str) -> None:
    """Run every field's `_check`, depth first."""
    for spec in fields(node):
        value = getattr(node, spec.name)
        key = f"{prefix}{spec.name}"
        check = spec.metadata.get("check")
        problem = check(value) if check else None
        if problem:
            raise _fail(key, value, problem)
        if is_dataclass(value):
            _check_fields(value, f"{key}.")


def _check_across_fields(settings: Config) -> None:
    """What one field cannot say alone: the platform, the dataset's files, the optimiser group."""
    method = settings.data.multiprocessing_context
    if method is not None and str(method) not in multiprocessing.get_all_start_methods():
        raise _fail("data.multiprocessing_context", method, "this platform does not offer that method")
    ds = settings.dataset
    if len(ds.mean) != 3 or len(ds.std) != 3 or min(ds.std) <= 0:
        raise ConfigError("dataset.mean and dataset.std must each hold 3 values, with std > 0")
    if isinstance(ds, ImageFolderConfig):
        if not ds.root:
            raise ConfigError("dataset.root is required with dataset=imagefolder: pass dataset.root=/path/to/images")
        if not os.path.isdir(os.path.expanduser(ds.root)):
            raise ConfigError(f"dataset.root={ds.root} is not a directory: point it at a folder of class folders")
    if isinstance(ds, ShardsConfig) and not ds.root:
        raise ConfigError(
            "dataset.root is required with dataset=shards: pass dataset.root=<directory or s3://bucket/prefix> "
            "written by `imgtrain-shards <image folder> <destination>`"
        )
    if (
        isinstance(ds, ShardsConfig)
        and not ds.root.startswith("s3://")
        and not os.path.isdir(os.path.expanduser(ds.root))
    ):
        raise ConfigError(f"dataset.root={ds.root} is not a directory: point it at what imgtrain-shards wrote")
    if not isinstance(settings.optim, SGDConfig | AdamWConfig):
        raise ConfigError("optim must be one of the optim group's options: optim=sgd or optim=adamw")


def validate(cfg: DictConfig) -> Config:
    """Check every value before any data is touched; return the config as typed dataclasses."""
    try:
        settings: Config = OmegaConf.to_object(cfg)  # resolves interpolations and enforces types
    except Exception as err:  # OmegaConf's messages are several lines; keep the first, which names the key
        raise ConfigError(str(err).splitlines()[0]) from err
    _check_fields(settings, "")
    _check_across_fields(settings)
    return settings
