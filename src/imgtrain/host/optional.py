"""The optional engines: packages only some runs use, imported when such a run starts, never by the others.

A fork that trains from an image folder needs neither LitData nor boto3 nor Optuna, and the GPU box that runs the
CUDA tests has none of them; one that trains torchvision's models needs no timm. Each is declared as an extra in
pyproject.toml (`pip install -e '.[shards]'`); `make install` installs them all. A run that needs a missing one (or
one whose compiled library fails to load) ends in one line naming the package, what needs it and the command that
installs it.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from types import ModuleType

from imgtrain.common.errors import ConfigError, first_line


@dataclass(frozen=True)
class Engine:
    """An importable module, the distribution pip installs it from, and the extra of imgtrain that declares it."""

    module: str
    package: str
    extra: str


ENGINES = {
    engine.module: engine
    for engine in (
        Engine("litdata", "litdata", "shards"),  # dataset=shards, imgtrain-shards
        Engine("boto3", "boto3", "shards"),  # object storage for dataset=shards and imgtrain-shards
        Engine("optuna", "optuna", "search"),  # hparams_search
        Engine("torchdata", "torchdata", "threads"),  # data.engine=threads
        Engine("timm", "timm", "timm"),  # model=timm
        Engine("huggingface_hub", "huggingface_hub", "timm"),  # model=timm model.pretrained=true: its weights' cache
        Engine("nvidia.nvimgcodec", "nvidia-nvimgcodec-cu13", "gpu-decode"),  # dataset.gpu_decoder=nvimgcodec
    )
}
# What fails when a module cannot be used: missing (ImportError), or a compiled library that does not load with
# this torch (TorchCodec raises RuntimeError; a missing shared object, OSError).
LOAD_ERRORS = (ImportError, OSError, RuntimeError)


class MissingEngine(ConfigError):
    """An optional package a run needs is missing or does not load (exit status 2, before any work starts)."""


def install_hint(engine: Engine) -> str:
    return f"pip install -e '.[{engine.extra}]' in the repository (make install installs every extra)"


def require(module: str, needed_by: str) -> ModuleType:
    """Import `module` (one of ENGINES, or a submodule of one) for `needed_by` (what the user asked for, e.g.
    "dataset=shards")."""
    engine = ENGINES.get(module) or ENGINES[module.partition(".")[0]]
    try:
        return importlib.import_module(module)
    except LOAD_ERRORS as error:
        raise MissingEngine(
            f"{needed_by} needs {engine.package}, which cannot be imported here ({first_line(error)}): "
            f"{install_hint(engine)}"
        ) from error


def require_extra(extra: str, needed_by: str) -> None:
    """Check every module of imgtrain's `extra` (e.g. "shards") before `needed_by` uses any of them."""
    for module, engine in ENGINES.items():
        if engine.extra == extra:
            require(module, needed_by)


def missing(module: str) -> bool:
    """Whether `module` cannot be imported here (for messages about a choice that needs it)."""
    try:
        importlib.import_module(module)
    except LOAD_ERRORS:
        return True
    return False
