"""`validate`: every value of the composed config checked before any data is touched, one line for the first
that is wrong; the config returned as the typed dataclasses of config/schema.py.

Each field's range check (`checked`, beside its field), then what one field cannot say alone (the platform, the
dataset's files), then the recipe's `_target_`s: each imports, and every key of the model, loss, schedule and
optim groups is a parameter of what its `_target_` names (a builder taking **kwargs takes any).
"""

from __future__ import annotations

import importlib
import inspect
import multiprocessing
from dataclasses import fields, is_dataclass
from typing import Any

import torch
from omegaconf import MISSING, DictConfig, OmegaConf

from imgtrain.common.errors import ConfigError
from imgtrain.config.checkpoint import BestOf
from imgtrain.config.data import LoaderEngine
from imgtrain.config.datasets import CustomConfig, Decode
from imgtrain.config.fields import TUNE
from imgtrain.config.renamed_keys import RECIPE_MOVES, moved_key_line
from imgtrain.config.schema import Config

# The arguments the run passes to each group's `_target_` itself (train/placement.py, train/step.py): not keys.
PASSED_BY_RUN = {
    "model": ("num_classes",),  # from the dataset
    "loss": (),
    "schedule": ("optimizer", "steps_per_epoch", "total_steps"),
}


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
    data = settings.data
    if data.worker_batch_size is not None and data.batch_size % data.worker_batch_size:
        raise _fail(
            "data.worker_batch_size", data.worker_batch_size, f"expected a divisor of data.batch_size={data.batch_size}"
        )
    engine_conflict = _engine_conflict(settings)
    if engine_conflict:
        raise ConfigError(engine_conflict)
    files_problem = ds.files_problem()  # the files the dataset reads (config/datasets.py), before any step
    if files_problem:
        raise ConfigError(files_problem)
    system = settings.system
    if system.compile and system.compile_mode.records_cuda_graphs and not settings.data.drop_last:
        raise ConfigError(
            f"system.compile_mode={system.compile_mode.name} records CUDA graphs for one batch shape, and "
            "data.drop_last=false gives the last batch of each epoch another: use data.drop_last=true, or "
            "system.compile_mode=default"
        )


def _engine_conflict(settings: Config) -> str | None:
    """data.engine=threads (or tune) where the training batches take another path: one line, before any work."""
    engine = settings.data.engine
    if engine == LoaderEngine.tune and settings.data.num_workers != TUNE:
        return (
            f"data.engine=tune is chosen by data.num_workers=tune's probe, and data.num_workers is "
            f"{settings.data.num_workers}: set data.num_workers=tune, or name the engine (dataloader or threads)"
        )
    if engine == LoaderEngine.dataloader:
        return None
    other = "use data.engine=dataloader"
    engine = f"data.engine={engine}"
    if settings.data.device_resident:
        return f"{engine} has no loader to run: data.device_resident=true keeps the training set on the device; {other}"
    if getattr(settings.dataset, "decode", Decode.cpu) == Decode.cuda:
        return f"{engine} is not available with dataset.decode=cuda (the GPU decodes in its own path); {other}"
    if settings.dataset.name == "shards":
        return f"{engine} is not available with dataset=shards (LitData streams it itself); {other}"
    return None


# ----------------------------------------------------------------------------- the recipe's `_target_`s
def _target(path: Any) -> Any:
    """What a `_target_` names, or None where it does not import."""
    module, _, name = str(path).rpartition(".")
    try:
        return getattr(importlib.import_module(module), name) if module else None
    except (ImportError, AttributeError, ValueError):
        return None


def _keys(node: Any) -> dict[str, Any]:
    """A group's keys: its schema's fields and any `+key` OmegaConf added to it (an attribute beside them), or a
    fork's file without a schema (a dict)."""
    return dict(vars(node)) if is_dataclass(node) else dict(node or {})


def _check_builder_keys(group: str, node: Any) -> None:
    """`group`'s `_target_` imports, and each of its keys is one of its parameters: `+model.depth=3` is one line
    here, not a TypeError from the builder once the data is planned. A builder taking **kwargs takes any key."""
    keys = _keys(node)
    target = keys.pop("_target_", None)
    built = _target(target)
    if not callable(built):
        raise ConfigError(f"{group}._target_={target} does not import: name a class or function (conf/{group}/)")
    try:
        parameters = inspect.signature(built).parameters
    except (TypeError, ValueError):  # a builtin without a readable signature: its call will say
        return
    if any(p.kind == inspect.Parameter.VAR_KEYWORD for p in parameters.values()):
        return
    passed = PASSED_BY_RUN[group]
    unknown = [key for key in keys if key not in parameters and key not in passed]
    if unknown:
        taken = [name for name, p in parameters.items() if name not in passed and p.kind != p.VAR_POSITIONAL]
        raise ConfigError(
            f"{group}.{unknown[0]} is not a parameter of {target}; it takes: {', '.join(taken) or 'no key'}"
            + (f" ({', '.join(passed)} from the run)" if passed else "")
        )


def _check_recipe(settings: Config) -> None:
    """optim names any torch.optim optimizer, with its lr and only its arguments; model, loss and schedule name
    what imports, with only its parameters; checkpoint.best_of=ema has an EMA to follow; no key that moved was
    added back (`+train.label_smoothing` composes: OmegaConf adds a `+` key to a schema's node)."""
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
    for group in PASSED_BY_RUN:
        _check_builder_keys(group, getattr(settings, group))
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
