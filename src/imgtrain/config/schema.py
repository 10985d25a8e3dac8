"""Typed config schemas (dataclasses in Hydra's ConfigStore): the one place every default is set.

OmegaConf enforces the types and the Enum choices at composition time, so `data.batch_size=abc` and
`system.precision=fp8` fail before `run` starts, naming the key and the accepted values. Range checks sit
next to their fields (`_check`); `validate` runs them and the few checks that span fields, once, and returns
the config as these dataclasses. The YAML files in conf/ only choose between schemas and set what differs.
"""

from __future__ import annotations

import inspect
import multiprocessing
import os
from dataclasses import dataclass, field, fields, is_dataclass
from typing import Any

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, DictConfig, OmegaConf
from torch.utils.data import DataLoader

from imgtrain.config.datasets import (
    CifarConfig,
    DatasetConfig,
    ImageFolderConfig,
    ShapesConfig,
    ShardsConfig,
    SyntheticConfig,
)
from imgtrain.config.fields import AUTO, TUNE, AugmentOn, Choice, at_least, auto_or_bool, checked, is_int
from imgtrain.config.renamed_keys import moved_key_line
from imgtrain.resilience.errors import ConfigError


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


class CompileMode(Choice):
    """torch.compile's `mode` (system.compile_mode): the names are typed on the command line, the values are
    torch's (reduce_overhead is torch's "reduce-overhead")."""

    default = "default"  # Inductor's fused kernels, launched one by one
    reduce_overhead = "reduce-overhead"  # and CUDA graphs: one launch per graph (launch-bound small models)
    max_autotune = "max-autotune"  # and Triton autotuning of matmuls and convolutions (long compile), CUDA graphs
    max_autotune_no_cudagraphs = "max-autotune-no-cudagraphs"

    @property
    def records_cuda_graphs(self) -> bool:
        """Whether this mode replays CUDA graphs (on a CUDA device): fixed shapes, a step-begin mark per step."""
        return self in (CompileMode.reduce_overhead, CompileMode.max_autotune)


class NonFinite(Choice):
    stop = "stop"  # keep the last good checkpoint and stop
    skip = "skip"  # skip the update (counted); reads the loss every step


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


# ----------------------------------------------------------------------------- data (the DataLoader)
def _workers(value: Any) -> str | None:
    ok = value in (AUTO, TUNE) or (is_int(value) and value >= 0)
    return None if ok else "expected an integer >= 0, auto or tune"


def _in_order(value: bool) -> str | None:
    return None if value or "in_order" in inspect.signature(DataLoader).parameters else "needs torch >= 2.6"


@dataclass
class DataConfig:
    """Every DataLoader knob. Each one is overridable as data.<key>=..."""

    batch_size: int = checked(64, at_least(1, note="images per process"))  # global: x world_size
    num_workers: Any = checked(AUTO, _workers)  # auto: CPUs of this process / local world size, minus one
    # num_workers=tune: before training, probe the model alone and the loader at a few worker counts in
    # interleaved rounds (this many seconds in all, fewer once the choice is separated) and keep the fewest
    # workers that stay 1.25x ahead of the model
    tune_budget_s: float = checked(20.0, lambda v: None if v >= 2 else "expected seconds >= 2")
    pin_memory: bool = True  # page-locked host buffers; only meaningful with CUDA (turned off on CPU)
    prefetch_factor: int | None = checked(2, at_least(1, null=""))  # batches ahead per worker
    persistent_workers: bool = True  # keep workers alive across epochs instead of re-forking them
    # false: a batch a worker finishes early may come before an earlier, slower one. A mid-epoch resume then
    # repeats and skips up to num_workers x prefetch_factor batches of that epoch (it resumes by position)
    in_order: bool = checked(True, _in_order)
    drop_last: bool = True  # training only: avoids a tiny last batch (noisy BatchNorm, uneven DDP ranks)
    shuffle: bool = True  # training only; under DDP the DistributedSampler shuffles instead
    distributed_sampler: Any = checked(AUTO, auto_or_bool)  # auto: on under DDP
    multiprocessing_context: StartMethod | None = None  # null: the platform's default
    timeout: float = checked(0.0, at_least(0, "seconds", note="0 waits forever"))  # for a batch from a worker
    seed_workers: bool = True  # seed python/numpy/torch in each worker so augmentation is reproducible
    val_batch_size: int | None = checked(None, at_least(1, null=""))  # null: 2 x batch_size
    # crop, resize and flip where: auto, workers or device (data/resample.py: two matmuls for the whole batch)
    augment_on: AugmentOn = AugmentOn.auto
    device_resident: bool = False  # whole training set as one uint8 tensor on the device, batched crop/flip there
    prefetch_to_device: bool = True  # on CUDA with pin_memory: copy the next batch on a side stream
    max_bad_samples: int | None = checked(100, at_least(0, null="no limit"))
    stage_timings: bool = True  # time read/decode/augment/collate in the workers, transfer and copy in the loop


# ----------------------------------------------------------------------------- model and optimizer
@dataclass
class ModelConfig:
    _target_: str = "imgtrain.train.model.build_model"
    arch: Arch = Arch.resnet18  # torchvision's ResNets
    cifar_stem: bool = False  # 3x3 stride-1 stem and no max-pool, for 32-px images
    zero_init_residual: bool = False

    @property
    def name(self) -> str:
        """What the log and metrics.json call the model: the ResNet's arch, or the builder a fork's entry names."""
        return str(self.arch) if self._target_.endswith(".build_model") else self._target_.rsplit(".", 1)[-1]


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


# ----------------------------------------------------------------------------- training, by concern
def _resume(value: str) -> str | None:
    if value in (AUTO, "none") or os.path.isfile(os.path.expanduser(value)):
        return None
    return "expected auto, none or the path of an existing checkpoint file"


_MINUTES = "expected minutes > 0, or null (save at every epoch end instead)"


_SECONDS = "expected seconds > 0"


@dataclass
class TrainConfig:
    """The recipe: how long, from which seed, the learning-rate warmup and the loss. train.<key>=..."""

    epochs: int = checked(5, at_least(1))
    max_steps: int | None = checked(None, at_least(1, null=""))  # stop after this many optimizer steps
    seed: int = 0
    lr_warmup_epochs: float = checked(0.5, at_least(0, "a number"))  # linear LR warmup, then cosine to zero
    label_smoothing: float = checked(0.0, lambda v: None if 0.0 <= v < 1.0 else "expected a number in [0, 1)")


@dataclass
class SystemConfig:
    """Where and how the model runs. system.<key>=..."""

    device: Device = Device.auto
    precision: Precision = Precision.auto
    channels_last: Any = checked(AUTO, auto_or_bool)  # auto: on for CUDA
    compile: bool = False  # torch.compile the model
    compile_mode: CompileMode = CompileMode.default  # with compile=true: default, reduce_overhead (CUDA graphs), ...
    deterministic: bool = False  # deterministic algorithms, cuDNN autotuning off: bit-exact reruns, also on GPU


@dataclass
class CheckpointConfig:
    """Saving and resuming. checkpoint.<key>=..."""

    resume: str = checked(AUTO, _resume)  # auto: the run directory's checkpoints/last.pt, if any; none; a path
    save: bool = True  # last.pt, last.prev.pt and best.pt under <run dir>/checkpoints (mode=train)
    # last.pt every this many minutes of wall time (rank 0's clock, checked at log windows), written in the
    # background; epoch ends save on the same clock (null: at every epoch end). Also saved: when validation
    # improves (best.pt), at the end of the run and on a stop signal.
    every_min: float | None = checked(10.0, lambda v: None if v is None or v > 0 else _MINUTES)
    every_n_steps: int = checked(0, at_least(0, note="0 = off"))  # also every this many steps


@dataclass
class MetricsConfig:
    """What is measured and logged, and how often. metrics.<key>=..."""

    # steps left out of throughput and data-wait figures: start-up (allocations, cuDNN autotuning), first batches
    skip_first_steps: int = checked(10, at_least(0))
    log_every_n_steps: int = checked(20, at_least(1))  # when the loop reads the loss back and logs
    progress_bar: Any = checked(AUTO, auto_or_bool)  # auto: only on a terminal
    monitor_interval_s: float = checked(0.5, lambda v: None if v > 0 else _SECONDS)  # NVML/CPU/RSS samples
    # After training, time the model alone (a copy, on a batch already on the device) to tell CPU contention
    # from compute-bound. auto: only when workers and training may compete for the CPUs
    compute_probe: Any = checked(AUTO, auto_or_bool)
    # A torch.profiler trace of profile_steps steps after skip_first_steps (+1 profiler warm-up step), rank 0
    # only: <run dir>/profile/trace_rank0.json.gz for https://ui.perfetto.dev, and the top operators as text.
    profile: bool = False
    profile_steps: int = checked(5, at_least(1, note="steps recorded"))


@dataclass
class FaultsConfig:
    """What a run does when something goes wrong while training. faults.<key>=... (The DataLoader's own limits,
    data.max_bad_samples and data.timeout, are data keys.)"""

    nonfinite: NonFinite = NonFinite.stop  # a NaN/inf loss: stop, or skip the step (counted)
    dist_timeout_s: float = checked(600.0, lambda v: None if v > 0 else _SECONDS)  # a collective waits this long


@dataclass
class Config:
    dataset: DatasetConfig = MISSING
    model: ModelConfig = MISSING
    data: DataConfig = MISSING
    optim: Any = MISSING
    train: TrainConfig = MISSING
    system: SystemConfig = MISSING
    checkpoint: CheckpointConfig = MISSING
    metrics: MetricsConfig = MISSING
    faults: FaultsConfig = MISSING
    mode: Mode = Mode.train
    optimized_metric: Metric = Metric.val_acc  # what run() returns to a sweeper: a key of metrics.json
    # A sweep dimension that changes nothing: `-m repeat=0,1 data.num_workers=0,2` runs each setting twice,
    # interleaved (the first key varies slowest); the sweep report pools the repeats and measures the drift.
    repeat: int = checked(0, at_least(0))
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
    cs.store(group="train", name="base_train", node=TrainConfig)
    cs.store(group="system", name="base_system", node=SystemConfig)
    cs.store(group="checkpoint", name="base_checkpoint", node=CheckpointConfig)
    cs.store(group="metrics", name="base_metrics", node=MetricsConfig)
    cs.store(group="faults", name="base_faults", node=FaultsConfig)


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
    system = settings.system
    if system.compile and system.compile_mode.records_cuda_graphs and not settings.data.drop_last:
        raise ConfigError(
            f"system.compile_mode={system.compile_mode.name} records CUDA graphs for one batch shape, and "
            "data.drop_last=false gives the last batch of each epoch another: use data.drop_last=true, or "
            "system.compile_mode=default"
        )
    if not isinstance(settings.optim, SGDConfig | AdamWConfig):
        raise ConfigError("optim must be one of the optim group's options: optim=sgd or optim=adamw")


def validate(cfg: DictConfig) -> Config:
    """Check every value before any data is touched; return the config as typed dataclasses."""
    known = [spec.name for spec in fields(Config)]
    unknown = [str(key) for key in cfg if key not in known and key != "hydra"]  # `+name=...`: no schema reads it
    if unknown:
        node = cfg[unknown[0]]
        named = f"{unknown[0]}.{next(iter(node))}" if isinstance(node, DictConfig) and node else unknown[0]
        raise ConfigError(moved_key_line(named) or f"{named} is not a config key: the top level has {', '.join(known)}")
    try:
        settings: Config = OmegaConf.to_object(cfg)  # resolves interpolations and enforces types
    except Exception as err:  # OmegaConf's messages are several lines; keep the first, which names the key
        raise ConfigError(str(err).splitlines()[0]) from err
    _check_fields(settings, "")
    _check_across_fields(settings)
    return settings
