"""Typed config schemas (dataclasses in Hydra's ConfigStore): the one place every default is set.

OmegaConf enforces the types and the Enum choices at composition time, so `data.batch_size=abc` and
`system.precision=fp8` fail before `run` starts, naming the key and the accepted values. Range checks sit
next to their fields (`_check`); `validate` runs them and the few checks that span fields, once, and returns
the config as these dataclasses. The YAML files in conf/ only choose between schemas and set what differs.
"""

from __future__ import annotations

import importlib
import inspect
import multiprocessing
import os
from dataclasses import dataclass, field, fields, is_dataclass
from typing import Any

import torch
from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, DictConfig, OmegaConf
from torch.utils.data import DataLoader

from imgtrain.common.errors import ConfigError
from imgtrain.config.datasets import (
    CifarConfig,
    CsvConfig,
    CustomConfig,
    ImageFolderConfig,
    ShapesConfig,
    ShardsConfig,
    SyntheticConfig,
)
from imgtrain.config.fields import AUTO, TUNE, AugmentOn, Choice, at_least, auto_or_bool, checked, is_int
from imgtrain.config.renamed_keys import RECIPE_MOVES, moved_key_line
from imgtrain.config.val_metrics import objectives


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


class BestOf(Choice):
    """Which weights best.pt keeps (checkpoint.best_of) when train.ema_decay is set."""

    model = "model"  # the trained weights, by their val_acc
    ema = "ema"  # their exponential moving average, by its val_acc_ema


# The keys of metrics.json that `run` can return to a sweeper: validation's (config/val_metrics.py), and speed's
OBJECTIVES = (*objectives(), "images_per_sec", "data_wait_frac", "step_time_ms")


def _objective(value: Any) -> str | None:
    return None if value in OBJECTIVES else f"expected one of {', '.join(OBJECTIVES)}"


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
def _pretrained(value: Any) -> str | None:
    ok = isinstance(value, bool) or os.path.isfile(os.path.expanduser(str(value)))
    return None if ok else "expected true (the library's weights, from its cache), false, or a weights file's path"


@dataclass
class TorchvisionModelConfig:
    """Any classification model of torchvision.models, by name (model=torchvision model.arch=convnext_tiny)."""

    _target_: str = "imgtrain.train.model.build_torchvision"
    arch: str = "resnet18"  # a name torchvision.models.list_models(torchvision.models) gives
    cifar_stem: bool = False  # ResNets only: 3x3 stride-1 stem and no max-pool, for 32-px images
    zero_init_residual: bool = False  # ResNets only: each block's last BatchNorm starts at zero
    # true: torchvision's default weights from the torch hub cache (never downloaded here); or a weights file
    pretrained: Any = checked(False, _pretrained)

    @property
    def name(self) -> str:
        """What the log and metrics.json call the model."""
        return self.arch


@dataclass
class TimmModelConfig:
    """Any timm model, by name (model=timm model.name=convnext_atto): needs the extra imgtrain[timm]."""

    _target_: str = "imgtrain.train.model.build_timm"
    name: str = MISSING  # a name timm.list_models() gives, e.g. timm.list_models("*convnext*")
    pretrained: Any = checked(False, _pretrained)  # true: timm's weights from the Hugging Face cache; or a file
    drop_rate: float = checked(0.0, lambda v: None if 0.0 <= v < 1.0 else "expected a number in [0, 1)")
    drop_path_rate: float = checked(0.0, lambda v: None if 0.0 <= v < 1.0 else "expected a number in [0, 1)")


def model_name(model: Any) -> str:
    """What the log and metrics.json call the model: its `name`, else the builder its `_target_` names."""
    name = getattr(model, "name", None) if not isinstance(model, dict) else model.get("name")
    target = model.get("_target_", "") if isinstance(model, dict) else getattr(model, "_target_", "")
    return str(name) if name else str(target).rsplit(".", 1)[-1]


@dataclass
class SGDConfig:
    _target_: str = "torch.optim.SGD"
    lr: float = 0.1  # for the global batch; scale it with world_size x batch_size
    momentum: float = 0.9
    weight_decay: float = 5e-4  # not applied to BatchNorm weights and biases
    nesterov: bool = True
    scale_lr_with_batch: bool = False  # true: lr x global batch / 256 (Goyal et al.), said in the log


@dataclass
class AdamWConfig:
    _target_: str = "torch.optim.AdamW"
    lr: float = 2e-3
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    weight_decay: float = 0.05  # not applied to BatchNorm weights and biases
    scale_lr_with_batch: bool = False  # true: lr x global batch / 256 (Goyal et al.), said in the log


# ----------------------------------------------------------------------------- loss and LR schedule
_SMOOTHING = "expected a number in [0, 1)"


@dataclass
class CrossEntropyConfig:
    """torch.nn.CrossEntropyLoss: hard labels, or the soft ones mixup/cutmix make."""

    _target_: str = "torch.nn.CrossEntropyLoss"  # a loss module's class: (logits, targets) -> the mean loss
    # the share of each target moved to the uniform distribution, in [0, 1); torchvision's recipes use 0.1
    label_smoothing: float = checked(0.0, lambda v: None if 0.0 <= v < 1.0 else _SMOOTHING)


@dataclass
class FocalLossConfig:
    """Focal loss (Lin et al., 2017) on the softmax: cross-entropy weighted by (1 - p)^gamma per example."""

    _target_: str = "imgtrain.train.losses.FocalLoss"  # a loss module's class: (logits, targets) -> the mean loss
    gamma: float = checked(2.0, at_least(0, "a number"))  # the focusing exponent; 0 = cross-entropy
    # the share of each target moved to the uniform distribution, in [0, 1)
    label_smoothing: float = checked(0.0, lambda v: None if 0.0 <= v < 1.0 else _SMOOTHING)


@dataclass
class WarmupCosineConfig:
    """Linear warm-up, then a cosine to zero at the last step."""

    _target_: str = "imgtrain.train.schedules.warmup_cosine"  # (optimizer, steps_per_epoch, total_steps, ...)
    warmup_epochs: float = checked(0.5, at_least(0, "a number"))  # linear from lr / warm-up steps to lr; 0 = none


@dataclass
class StepDecayConfig:
    """Linear warm-up, then the LR times `gamma` every `step_epochs` epochs (torchvision's StepLR recipe)."""

    _target_: str = "imgtrain.train.schedules.warmup_step"  # (optimizer, steps_per_epoch, total_steps, ...)
    warmup_epochs: float = checked(0.0, at_least(0, "a number"))  # linear from lr / warm-up steps to lr; 0 = none
    step_epochs: float = checked(30.0, lambda v: None if v > 0 else "expected epochs > 0")  # counted after warm-up
    gamma: float = checked(0.1, lambda v: None if 0.0 < v <= 1.0 else "expected a factor in (0, 1]")  # per drop


# ----------------------------------------------------------------------------- training, by concern
def _resume(value: str) -> str | None:
    if value in (AUTO, "none") or os.path.isfile(os.path.expanduser(value)):
        return None
    return "expected auto, none or the path of an existing checkpoint file"


_MINUTES = "expected minutes > 0, or null (save at every epoch end instead)"


_SECONDS = "expected seconds > 0"


@dataclass
class TrainConfig:
    """The recipe: how long, from which seed, mixing and the weights' average. train.<key>=..."""

    epochs: int = checked(5, at_least(1))
    max_steps: int | None = checked(None, at_least(1, null=""))  # stop after this many optimizer steps
    seed: int = 0
    # mixup/cutmix on the device batch (torchvision.transforms.v2.MixUp/CutMix); 0 = off. With both on, each
    # mixed batch uses one of them, chosen at random, as torchvision's reference does
    mixup_alpha: float = checked(0.0, at_least(0, "a number", note="0 = off"))
    cutmix_alpha: float = checked(0.0, at_least(0, "a number", note="0 = off"))
    mix_prob: float = checked(1.0, lambda v: None if 0.0 <= v <= 1.0 else "expected a probability in [0, 1]")
    # an exponential moving average of the weights (torch.optim.swa_utils.AveragedModel), validated beside them
    ema_decay: float | None = checked(None, lambda v: None if v is None or 0.0 < v < 1.0 else "expected null or (0, 1)")
    ema_every_n_steps: int = checked(1, at_least(1, note="optimizer steps between EMA updates"))


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
    best_of: BestOf = BestOf.model  # with train.ema_decay: best.pt keeps the best model, or the best EMA


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
    dataset: Any = MISSING  # a DatasetConfig; dataset=custom's keys become a CustomConfig in `validate`
    model: Any = MISSING  # TorchvisionModelConfig, TimmModelConfig, or a fork's entry with its own `_target_`
    data: DataConfig = MISSING
    optim: Any = MISSING  # any torch.optim optimizer by `_target_`; SGDConfig and AdamWConfig are typed
    loss: Any = MISSING  # any loss module by `_target_`
    schedule: Any = MISSING  # any LR-schedule builder by `_target_`
    train: TrainConfig = MISSING
    system: SystemConfig = MISSING
    checkpoint: CheckpointConfig = MISSING
    metrics: MetricsConfig = MISSING
    faults: FaultsConfig = MISSING
    mode: Mode = Mode.train
    optimized_metric: Any = checked("val_acc", _objective)  # what run() returns to a sweeper: a key of metrics.json
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
    cs.store(group="dataset", name="base_csv", node=CsvConfig)
    cs.store(group="dataset", name="base_custom", node=CustomConfig)
    cs.store(group="model", name="base_torchvision", node=TorchvisionModelConfig)
    cs.store(group="model", name="base_timm", node=TimmModelConfig)
    cs.store(group="optim", name="base_sgd", node=SGDConfig)
    cs.store(group="optim", name="base_adamw", node=AdamWConfig)
    cs.store(group="loss", name="base_cross_entropy", node=CrossEntropyConfig)
    cs.store(group="loss", name="base_focal", node=FocalLossConfig)
    cs.store(group="schedule", name="base_warmup_cosine", node=WarmupCosineConfig)
    cs.store(group="schedule", name="base_step", node=StepDecayConfig)
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
    augment_conflict = ds.augment_conflict(settings.data.augment_on, settings.data.device_resident)
    if augment_conflict:
        raise ConfigError(augment_conflict)
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
    for key in ("train", "val") if isinstance(ds, CsvConfig) else ():  # each split's CSV (data/csv_rows.py)
        file = getattr(ds, key)
        if not file or not os.path.isfile(os.path.expanduser(file)):
            given = f"dataset.{key}={file} is not a file" if file else f"dataset.{key} is required with dataset=csv"
            raise ConfigError(f"{given}: pass dataset.{key}=<a CSV or TSV of image path and label, one row per image>")
    system = settings.system
    if system.compile and system.compile_mode.records_cuda_graphs and not settings.data.drop_last:
        raise ConfigError(
            f"system.compile_mode={system.compile_mode.name} records CUDA graphs for one batch shape, and "
            "data.drop_last=false gives the last batch of each epoch another: use data.drop_last=true, or "
            "system.compile_mode=default"
        )


# ----------------------------------------------------------------------------- the recipe's `_target_`s
def _target(path: Any) -> Any:
    """What a `_target_` names, or None where it does not import."""
    module, _, name = str(path).rpartition(".")
    try:
        return getattr(importlib.import_module(module), name) if module else None
    except (ImportError, AttributeError, ValueError):
        return None


def _keys(node: Any) -> dict[str, Any]:
    """A group's keys: its schema's fields, or a fork's file without one (a dict)."""
    return {spec.name: getattr(node, spec.name) for spec in fields(node)} if is_dataclass(node) else dict(node or {})


def _check_recipe(settings: Config) -> None:
    """optim names any torch.optim optimizer, with its lr and only its arguments; loss and schedule name what
    imports; checkpoint.best_of=ema has an EMA to follow; no key that moved was added back (`+train.label_smoothing`
    composes: OmegaConf adds a `+` key to a schema's node)."""
    for old in RECIPE_MOVES:
        if hasattr(getattr(settings, old.split(".")[0]), old.split(".")[1]):
            raise ConfigError(moved_key_line(old))
    optim = _keys(settings.optim)
    target, made_here = optim.get("_target_"), ("_target_", "scale_lr_with_batch")  # the latter: build_step's
    cls = _target(target)
    if not (isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer)):
        raise ConfigError(
            f"optim._target_={target} is not a torch.optim optimizer: name its class, e.g. "
            "optim._target_=torch.optim.RMSprop (optim=sgd and optim=adamw are ready-made)"
        )
    if optim.get("lr") in (None, MISSING):
        raise ConfigError(f"optim.lr is required with optim._target_={target}: pass optim.lr=<the base learning rate>")
    taken = [name for name in inspect.signature(cls).parameters if name != "params"]
    unknown = [key for key in optim if key not in taken and key not in made_here]
    if unknown:
        raise ConfigError(
            f"optim.{unknown[0]} is not an argument of {target} (it takes {', '.join(taken)}): an optimizer with "
            "other arguments gets a file of its own, conf/optim/<name>.yaml, naming its `_target_` and its keys"
        )
    for group in ("loss", "schedule"):
        target = _keys(getattr(settings, group)).get("_target_")
        if not callable(_target(target)):
            raise ConfigError(f"{group}._target_={target} does not import: name a class or function (conf/{group}/)")
    if settings.checkpoint.best_of == BestOf.ema and settings.train.ema_decay is None:
        raise ConfigError(
            "checkpoint.best_of=ema needs an EMA to follow: set train.ema_decay (e.g. 0.9999), or use "
            "checkpoint.best_of=model"
        )


def _with_custom_dataset(cfg: DictConfig) -> DictConfig:
    """`cfg` with dataset=custom (or a fork's dataset file with no schema) as a CustomConfig: `dataset._target_`, the
    user's Dataset class, becomes `dataset_class`; the keys CustomConfig does not know (`+dataset.root=...`) go to
    `options`, which the class's constructor receives."""
    node = cfg.get("dataset")
    if not isinstance(node, DictConfig) or OmegaConf.get_type(node) not in (dict, CustomConfig):
        return cfg
    keys = OmegaConf.to_container(node, resolve=True)
    target = keys.pop("_target_", None)
    if target not in (None, CustomConfig._target_):
        keys["dataset_class"] = target
    if keys.get("dataset_class") in (None, MISSING):
        raise ConfigError(
            "dataset._target_ is required with dataset=custom: pass dataset._target_=your.module.YourDataset, a "
            "map-style Dataset taking split='train'|'val' and returning (PIL image or uint8 tensor, label)"
        )
    known = {spec.name for spec in fields(CustomConfig)} - {"_target_", "options"}
    typed = {key: keys.pop(key) for key in list(keys) if key in known}
    options = {**(keys.pop("options", None) or {}), **keys}
    cfg = cfg.copy()
    cfg.dataset = OmegaConf.merge(OmegaConf.structured(CustomConfig), {**typed, "options": options})
    return cfg


def validate(cfg: DictConfig) -> Config:
    """Check every value before any data is touched; return the config as typed dataclasses."""
    known = [spec.name for spec in fields(Config)]
    unknown = [str(key) for key in cfg if key not in known and key != "hydra"]  # `+name=...`: no schema reads it
    if unknown:
        node = cfg[unknown[0]]
        named = f"{unknown[0]}.{next(iter(node))}" if isinstance(node, DictConfig) and node else unknown[0]
        raise ConfigError(moved_key_line(named) or f"{named} is not a config key: the top level has {', '.join(known)}")
    try:
        cfg = _with_custom_dataset(cfg)
        settings: Config = OmegaConf.to_object(cfg)  # resolves interpolations and enforces types
    except Exception as err:  # OmegaConf's messages are several lines; keep the first, which names the key
        raise ConfigError(str(err).splitlines()[0]) from err
    _check_fields(settings, "")
    _check_across_fields(settings)
    _check_recipe(settings)
    return settings
