"""Typed config schemas (dataclasses in Hydra's ConfigStore) and the checks Hydra cannot express.

OmegaConf enforces the types at composition time, so `data.batch_size=abc` fails before `run` starts.
`validate` then checks ranges and choices and turns the config into these dataclasses.
"""

from __future__ import annotations

import multiprocessing
import os
from dataclasses import dataclass, field
from typing import Any

from hydra.core.config_store import ConfigStore
from hydra.errors import CompactHydraException
from omegaconf import MISSING, DictConfig, OmegaConf

AUTO = "auto"
START_METHODS = ("fork", "spawn", "forkserver")
ARCHS = ("resnet18", "resnet34", "resnet50")
DEVICES = (AUTO, "cpu", "cuda")
PRECISIONS = (AUTO, "fp32", "bf16", "fp16")
MODES = ("train", "loader", "compute")
NONFINITE = ("stop", "skip")
RESUME_KEYWORDS = (AUTO, "none")
# Keys of metrics.json that `run` can return to a sweeper.
OPTIMIZABLE = ("val_acc", "best_val_acc", "val_loss", "images_per_sec", "data_wait_frac", "step_time_ms")
IMAGENET_MEAN = [0.485, 0.456, 0.406]
IMAGENET_STD = [0.229, 0.224, 0.225]


class RunError(CompactHydraException):
    """A failure the user can act on, printed as one line without a traceback (unless HYDRA_FULL_ERROR=1)."""


class ConfigError(RunError):
    """A bad setting: detected before any work starts (exit status 2)."""


# ----------------------------------------------------------------------------- data (the DataLoader)
@dataclass
class DataConfig:
    """Every DataLoader knob. Each one is overridable as data.<key>=..."""

    batch_size: int = 64  # per process: the global batch under DDP is world_size x batch_size
    num_workers: Any = AUTO  # int >= 0, or "auto": CPUs of this process / local world size, minus one
    pin_memory: bool = True  # page-locked host buffers; only meaningful with CUDA (turned off on CPU)
    prefetch_factor: int | None = 2  # batches loaded ahead per worker; null = PyTorch's default
    persistent_workers: bool = True  # keep workers alive across epochs instead of re-forking them
    drop_last: bool = True  # training only: avoids a tiny last batch (noisy BatchNorm, uneven DDP ranks)
    shuffle: bool = True  # training only; under DDP the DistributedSampler shuffles instead
    distributed_sampler: Any = AUTO  # "auto" (on under DDP), true or false
    multiprocessing_context: str | None = None  # null (platform default), fork, spawn or forkserver
    timeout: float = 0.0  # seconds to wait for a batch from a worker before raising; 0 = forever
    seed_workers: bool = True  # seed python/numpy/torch in each worker so augmentation is reproducible
    val_batch_size: int | None = None  # null = 2 x batch_size (no activations kept for backward)
    device_resident: bool = False  # whole training set as one uint8 tensor on the device, batched crop/flip there
    prefetch_to_device: bool = True  # on CUDA with pin_memory: copy the next batch on a side stream
    max_bad_samples: int | None = 100  # unreadable images to skip (each read counts) before stopping; null = no limit


# ----------------------------------------------------------------------------- datasets
@dataclass
class DatasetConfig:
    """Fields every dataset has. `_target_` is the builder that `hydra.utils.instantiate` calls."""

    _target_: str = MISSING
    name: str = MISSING
    image_size: int = 64  # side of the square training crop, in pixels
    mean: list[float] = field(default_factory=lambda: list(IMAGENET_MEAN))
    std: list[float] = field(default_factory=lambda: list(IMAGENET_STD))
    augment: bool = True


@dataclass
class ShapesConfig(DatasetConfig):
    """Procedurally drawn shapes, generated once as JPEG files in an ImageFolder layout."""

    _target_: str = "imgtrain.datasets.build_shapes"
    name: str = "shapes"
    image_size: int = 32
    root: str = "${data_dir}/shapes"
    num_train: int = 5000
    num_val: int = 1000
    seed: int = 0
    mean: list[float] = field(default_factory=lambda: [0.5, 0.5, 0.5])
    std: list[float] = field(default_factory=lambda: [0.25, 0.25, 0.25])


@dataclass
class SyntheticConfig(DatasetConfig):
    """Random uint8 images held in memory: no decode cost, for compute-bound measurements."""

    _target_: str = "imgtrain.datasets.build_synthetic"
    name: str = "synthetic"
    num_train: int = 4096
    num_val: int = 512
    num_classes: int = 10
    seed: int = 0


@dataclass
class ImageFolderConfig(DatasetConfig):
    """Any ImageNet-style folder: root/train/<class>/*, root/val/<class>/*, or root/<class>/* plus a split."""

    _target_: str = "imgtrain.datasets.build_imagefolder"
    name: str = "imagefolder"
    root: str | None = None
    val_fraction: float = 0.1  # used only when root has no val/ folder
    split_seed: int = 0
    image_size: int = 224
    val_resize: int | None = None  # null = image_size / 0.875, the usual ImageNet ratio
    decode: str = "cpu"  # cpu: workers decode; cuda: workers read bytes, the GPU decodes whole batches (nvJPEG)


@dataclass
class CifarConfig(DatasetConfig):
    """torchvision's CIFAR-10/100; downloaded on first use, with a clear message when offline."""

    _target_: str = "imgtrain.datasets.build_cifar"
    name: str = "cifar10"
    root: str = "${data_dir}/cifar"
    download: bool = True
    image_size: int = 32
    mean: list[float] = field(default_factory=lambda: [0.4914, 0.4822, 0.4465])
    std: list[float] = field(default_factory=lambda: [0.2470, 0.2435, 0.2616])


# ----------------------------------------------------------------------------- model and optimizer
@dataclass
class ModelConfig:
    _target_: str = "imgtrain.models.build_model"
    arch: str = "resnet18"  # resnet18, resnet34 or resnet50 (torchvision)
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
@dataclass
class TrainerConfig:
    epochs: int = 5
    max_steps: int | None = None  # stop after this many optimizer steps in total (quick runs, sweeps)
    device: str = AUTO  # auto (cuda when available), cpu or cuda
    precision: str = AUTO  # auto (bf16 on CUDA when supported, else fp32), fp32, bf16 or fp16
    channels_last: Any = AUTO  # auto (on for CUDA), true or false
    compile: bool = False  # torch.compile the model
    seed: int = 0
    deterministic: bool = False  # deterministic algorithms, cuDNN autotuning off: bit-exact reruns, also on GPU
    warmup_steps: int = 10  # steps excluded from throughput: start-up, first batches, allocator warm-up
    log_every_n_steps: int = 20  # when the loop reads loss and accuracy back from the GPU, and logs
    lr_warmup_epochs: float = 0.5  # linear LR warmup, then cosine decay to zero
    label_smoothing: float = 0.0
    progress_bar: Any = AUTO  # auto (only on a terminal), true or false
    monitor_interval_s: float = 0.5  # how often the background thread samples NVML, CPU and RSS
    dist_timeout_s: float = 600.0  # process-group timeout: how long a rank waits for the others in a collective
    resume: str = AUTO  # auto (the run directory's checkpoints/last.pt, if any), none, or a checkpoint path
    save_checkpoints: bool = True  # last.pt, last.prev.pt and best.pt under <run dir>/checkpoints (mode=train)
    ckpt_every_n_steps: int = 200  # also written at every epoch end and on SIGTERM/SIGUSR1; 0 = only then
    nonfinite: str = "stop"  # a NaN/inf loss: stop (keep the last good checkpoint) or skip the step (counted)


@dataclass
class Config:
    dataset: DatasetConfig = MISSING
    model: ModelConfig = MISSING
    data: DataConfig = MISSING
    optim: Any = MISSING
    trainer: TrainerConfig = MISSING
    mode: str = "train"  # train; loader: DataLoader + copy, no model; compute: model on a batch already on device
    optimized_metric: str = "val_acc"  # what run() returns to a sweeper: a key of metrics.json
    data_dir: str = "${oc.env:IMGTRAIN_DATA_DIR,'~/.cache/imgtrain'}"
    output_dir: str = "${hydra:runtime.output_dir}"


def _rank_zero_only(value: Any, fallback: Any = None) -> Any:
    """`value` on rank 0, `fallback` elsewhere: only rank 0 writes Hydra's .hydra/ and the log file."""
    from imgtrain.dist import global_rank

    return value if global_rank() == 0 else fallback


def register_configs() -> None:
    """Store the schemas so the YAML files in conf/ can name them as their base (`- base_...`)."""
    from imgtrain.dist import launch_time

    # use_cache, as Hydra's own `now`: the value travels with the pickled config to submitit jobs, requeued
    # ones included, so they find the same run directory (and resume from its checkpoints).
    OmegaConf.register_new_resolver(
        "launch_time", lambda fmt: launch_time().strftime(fmt), replace=True, use_cache=True
    )
    OmegaConf.register_new_resolver("rank_zero_only", _rank_zero_only, replace=True)
    cs = ConfigStore.instance()
    cs.store(name="base_config", node=Config)
    cs.store(group="data", name="base_data", node=DataConfig)
    cs.store(group="dataset", name="base_shapes", node=ShapesConfig)
    cs.store(group="dataset", name="base_synthetic", node=SyntheticConfig)
    cs.store(group="dataset", name="base_imagefolder", node=ImageFolderConfig)
    cs.store(group="dataset", name="base_cifar", node=CifarConfig)
    cs.store(group="model", name="base_model", node=ModelConfig)
    cs.store(group="optim", name="base_sgd", node=SGDConfig)
    cs.store(group="optim", name="base_adamw", node=AdamWConfig)
    cs.store(group="trainer", name="base_trainer", node=TrainerConfig)


# ----------------------------------------------------------------------------- validation
def _fail(key: str, value: Any, accepted: str) -> ConfigError:
    shown = "null" if value is None else str(value).lower() if isinstance(value, bool) else value
    return ConfigError(f"{key}={shown} is invalid: {accepted}")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_choice(key: str, value: Any, choices: tuple) -> None:
    if value not in choices:
        raise _fail(key, value, "accepted values are " + ", ".join("null" if c is None else str(c) for c in choices))


def _check_auto_bool(key: str, value: Any) -> None:
    if value != AUTO and not isinstance(value, bool):
        raise _fail(key, value, "accepted values are auto, true, false")


def _check_data(data: DataConfig) -> None:
    if data.batch_size < 1:
        raise _fail("data.batch_size", data.batch_size, "expected an integer >= 1 (images per process)")
    if data.val_batch_size is not None and data.val_batch_size < 1:
        raise _fail("data.val_batch_size", data.val_batch_size, "expected null or an integer >= 1")
    if data.num_workers != AUTO and not (_is_int(data.num_workers) and data.num_workers >= 0):
        raise _fail("data.num_workers", data.num_workers, "expected an integer >= 0 or auto")
    if data.prefetch_factor is not None and data.prefetch_factor < 1:
        raise _fail("data.prefetch_factor", data.prefetch_factor, "expected null or an integer >= 1")
    if data.max_bad_samples is not None and data.max_bad_samples < 0:
        raise _fail("data.max_bad_samples", data.max_bad_samples, "expected null (no limit) or an integer >= 0")
    if data.timeout < 0:
        raise _fail("data.timeout", data.timeout, "expected seconds >= 0 (0 waits forever)")
    _check_auto_bool("data.distributed_sampler", data.distributed_sampler)
    method = data.multiprocessing_context
    if method is not None:
        _check_choice("data.multiprocessing_context", method, (None, *START_METHODS))
        if method not in multiprocessing.get_all_start_methods():
            raise _fail("data.multiprocessing_context", method, "this platform does not offer that method")


def _check_dataset(ds: DatasetConfig) -> None:
    if ds.image_size < 8:
        raise _fail("dataset.image_size", ds.image_size, "expected an integer >= 8 (pixels)")
    if len(ds.mean) != 3 or len(ds.std) != 3 or min(ds.std) <= 0:
        raise ConfigError("dataset.mean and dataset.std must each hold 3 values, with std > 0")
    for key in ("num_train", "num_val", "num_classes"):
        if getattr(ds, key, 1) < 1:
            raise _fail(f"dataset.{key}", getattr(ds, key), "expected an integer >= 1")
    if isinstance(ds, ImageFolderConfig):
        _check_choice("dataset.decode", ds.decode, ("cpu", "cuda"))
        if not 0.0 < ds.val_fraction < 1.0:
            raise _fail("dataset.val_fraction", ds.val_fraction, "expected a fraction between 0 and 1")
        if not ds.root:
            raise ConfigError("dataset.root is required with dataset=imagefolder: pass dataset.root=/path/to/images")
        if not os.path.isdir(os.path.expanduser(ds.root)):
            raise ConfigError(f"dataset.root={ds.root} is not a directory: point it at a folder of class folders")


def _check_trainer(tr: TrainerConfig) -> None:
    if tr.epochs < 1:
        raise _fail("trainer.epochs", tr.epochs, "expected an integer >= 1")
    if tr.max_steps is not None and tr.max_steps < 1:
        raise _fail("trainer.max_steps", tr.max_steps, "expected null or an integer >= 1")
    for key in ("warmup_steps", "log_every_n_steps"):
        minimum = 0 if key == "warmup_steps" else 1
        if getattr(tr, key) < minimum:
            raise _fail(f"trainer.{key}", getattr(tr, key), f"expected an integer >= {minimum}")
    if tr.lr_warmup_epochs < 0:
        raise _fail("trainer.lr_warmup_epochs", tr.lr_warmup_epochs, "expected a number >= 0")
    if not 0.0 <= tr.label_smoothing < 1.0:
        raise _fail("trainer.label_smoothing", tr.label_smoothing, "expected a number in [0, 1)")
    if tr.dist_timeout_s <= 0:
        raise _fail("trainer.dist_timeout_s", tr.dist_timeout_s, "expected seconds > 0")
    if tr.monitor_interval_s <= 0:
        raise _fail("trainer.monitor_interval_s", tr.monitor_interval_s, "expected seconds > 0")
    if tr.ckpt_every_n_steps < 0:
        raise _fail("trainer.ckpt_every_n_steps", tr.ckpt_every_n_steps, "expected an integer >= 0 (0 = epoch ends)")
    _check_choice("trainer.nonfinite", tr.nonfinite, NONFINITE)
    if tr.resume not in RESUME_KEYWORDS and not os.path.isfile(os.path.expanduser(tr.resume)):
        raise _fail("trainer.resume", tr.resume, "expected auto, none or the path of an existing checkpoint file")
    _check_choice("trainer.device", tr.device, DEVICES)
    _check_choice("trainer.precision", tr.precision, PRECISIONS)
    _check_auto_bool("trainer.channels_last", tr.channels_last)
    _check_auto_bool("trainer.progress_bar", tr.progress_bar)


def validate(cfg: DictConfig) -> Config:
    """Check every value before any data is touched; return the config as typed dataclasses."""
    try:
        settings: Config = OmegaConf.to_object(cfg)  # resolves interpolations and enforces types
    except Exception as err:  # OmegaConf's messages are several lines; keep the first, which names the key
        raise ConfigError(str(err).splitlines()[0]) from err
    _check_data(settings.data)
    _check_dataset(settings.dataset)
    _check_trainer(settings.trainer)
    _check_choice("model.arch", settings.model.arch, ARCHS)
    _check_choice("mode", settings.mode, MODES)
    _check_choice("optimized_metric", settings.optimized_metric, OPTIMIZABLE)
    if not isinstance(settings.optim, SGDConfig | AdamWConfig):
        raise ConfigError("optim must be one of the optim group's options: optim=sgd or optim=adamw")
    return settings
