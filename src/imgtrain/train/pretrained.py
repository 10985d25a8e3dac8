"""Pretrained weights for the model builders (model.pretrained): the library's own weights, read from its cache and
never downloaded, or a weights file; each tensor whose name and shape the model has is copied, the others (a
classifier head for another number of classes, the CIFAR stem) stay at their init, and the log names them.

No file runs code: every pickle is read with weights_only=True, and only by a torch whose weights_only loader has
no known bypass (the checkpoints' guard). torchvision's cached file must also match the SHA-256 prefix in its
name, which torch.hub checks only when it downloads: a file planted in, or copied into, the cache is checked too."""

from __future__ import annotations

import hashlib
import logging
import os
import pickle
import re
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any
from urllib.parse import urlparse

import torch
import torchvision
from torch import nn

from imgtrain.common.errors import ConfigError, first_line
from imgtrain.common.safe_load import unsafe_torch_reason
from imgtrain.host import optional

log = logging.getLogger(__name__)

# The wrappers' prefixes in a state dict saved from the wrapped module: torch.compile's and DDP's, in either order.
WRAPPER_PREFIXES = ("_orig_mod.", "module.", "_orig_mod.")
NAMED_AT_MOST = 4  # tensors left at init that the log names one by one; the rest are counted


def hub_checkpoint(url: str) -> Path:
    """Where torch.hub.load_state_dict_from_url keeps `url`'s file (torchvision's weights, timm's older ones)."""
    return Path(torch.hub.get_dir()) / "checkpoints" / os.path.basename(urlparse(url).path)


def _fetch_hint(code: str, where: Any, files: str) -> str:
    return (
        f'this run never downloads: on a machine with network run python -c "{code}" and copy what it fetches to '
        f"{where}, or pass model.pretrained=/path/to/weights ({files})"
    )


def torchvision_weights(arch: str) -> tuple[dict[str, torch.Tensor], str]:
    """(state dict, where from) of torchvision's default weights for `arch`, read from the torch hub cache after
    its SHA-256 is checked against the prefix in its name. Read as torchvision's builders read it (torch.hub's
    loader: older zip-wrapped files too; DenseNet's old key names renamed), but with weights_only=True, and
    loaded into the model at its own number of classes, as torchvision would (strict)."""
    weights = torchvision.models.get_model_weights(arch).DEFAULT
    path = hub_checkpoint(weights.url)
    code = f"import torchvision; torchvision.models.get_model('{arch}', weights='DEFAULT')"
    if not path.is_file():
        raise ConfigError(
            f"model.pretrained=true: torchvision's {weights} for {arch} is not in the torch hub cache (looked for "
            f"{path}; TORCH_HOME moves it), and {_fetch_hint(code, path.parent, 'a state dict torch.save wrote')}"
        )
    refuse_unsafe_torch("model.pretrained=true")
    refetch = (
        f'fetch it again (this run never downloads: on a machine with network run python -c "{code}" and copy what '
        f"it fetches to {path.parent}; it is checked here against its name)"
    )
    _check_hash(path, f"model.pretrained=true: {path} is not torchvision's {weights}", refetch)
    categories = weights.meta.get("categories") or ()
    options = {"num_classes": len(categories)} if categories else {}
    try:
        # torch.hub's loader on the cached file (no download: it is there), as torchvision's builders call it
        state = weights.get_state_dict(progress=False, check_hash=True, map_location="cpu", weights_only=True)
        native = torchvision.models.get_model(arch, **options, **NATIVE_OPTIONS.get(arch, {}))
        native.load_state_dict(_renamed(state))
    except Exception as error:  # a truncated or foreign file: torch.load's errors vary (pickle, zip, EOF)
        raise ConfigError(f"model.pretrained=true: {path} cannot be read ({_refusal(error)})") from error
    return native.state_dict(), f"{weights} ({path})"


# What torchvision's builders of these set when they load weights: the files hold the auxiliary heads, and the
# random init they replace is skipped (GoogLeNet's warns that its default will change).
NATIVE_OPTIONS = {name: {"aux_logits": True, "init_weights": False} for name in ("googlenet", "inception_v3")}

# torchvision's DenseNet files name some keys as older torch allowed ("norm.1"): densenet._load_state_dict's pattern
DENSENET_OLD_KEY = re.compile(
    r"^(.*denselayer\d+\.(?:norm|relu|conv))\.((?:[12])\.(?:weight|bias|running_mean|running_var))$"
)


def _renamed(state: dict[str, Any]) -> dict[str, Any]:
    """`state` with DenseNet's old key names renamed, as torchvision's DenseNet builder does (others unchanged)."""
    return {(match.group(1) + match.group(2) if (match := DENSENET_OLD_KEY.match(key)) else key): value
            for key, value in state.items()}  # fmt: skip


def refuse_unsafe_torch(setting: str) -> None:
    """ConfigError (one line) under a torch whose weights_only loader has known bypasses: no file is read there."""
    unsafe = unsafe_torch_reason()
    if unsafe:
        raise ConfigError(f"{setting}: torch {torch.__version__} cannot read weights safely: {unsafe}")


def _check_hash(path: Path, what: str, hint: str) -> None:
    """The file's SHA-256 must begin with the hex digits its name ends with (`-<prefix>.pth`, torch.hub's
    HASH_REGEX): what torch.hub checks after a download, checked here on a file already in the cache."""
    found = torch.hub.HASH_REGEX.search(path.name)
    prefix = found.group(1) if found else ""
    if len(prefix) < 8:  # torchvision names each file so; a name without a prefix is not its file
        raise ConfigError(f"{what}: its name carries no SHA-256 prefix to check it against; {hint}")
    digest = hashlib.sha256()
    with open(path, "rb") as file:
        for block in iter(lambda: file.read(1 << 20), b""):
            digest.update(block)
    if not digest.hexdigest().startswith(prefix):
        raise ConfigError(
            f"{what}: its SHA-256 begins {digest.hexdigest()[: len(prefix)]}, its name says {prefix} (a damaged or "
            f"foreign file, never read); delete it, and {hint}"
        )


def _refusal(error: BaseException) -> str:
    """Why torch.load refused a file, in one line: weights_only's refused global (code that loading would have
    run), else the error's first line."""
    if isinstance(error, pickle.UnpicklingError):
        found = re.search(r"Unsupported global: (GLOBAL \S+)", str(error))
        what = f" ({found.group(1)})" if found else ""
        return f"it holds Python objects other than tensors and plain data{what}, which are never loaded"
    return first_line(error)


def timm_weights(timm: ModuleType, name: str) -> tuple[dict[str, torch.Tensor], str]:
    """(state dict, where from) of timm's default weights for `name`, read from the Hugging Face cache (or the torch
    hub cache, for the few with a URL only). timm builds the model with them at their own number of classes,
    through its documented local-file override (pretrained_cfg_overlay=dict(file=...)), so its checkpoint filters
    apply as on a download."""
    cfg = timm.models.get_pretrained_cfg(name)
    if cfg is None or not (cfg.hf_hub_id or cfg.url):
        raise ConfigError(
            f"model.pretrained=true: timm has no pretrained weights for {name}: list those with weights with "
            f"python -c \"import timm; print(timm.list_pretrained('{name.split('.')[0]}*'))\", or pass a file"
        )
    path, looked = _timm_cached(cfg)
    if path is None:
        code = f"import timm; timm.create_model('{name}', pretrained=True)"
        hint = _fetch_hint(code, looked, "a .safetensors or torch.save file")
        raise ConfigError(
            f"model.pretrained=true: timm's weights for {name} ({cfg.hf_hub_id or cfg.url}) are not in the cache "
            f"(looked in {looked}; HF_HOME moves it), and {hint}"
        )
    if path.suffix != ".safetensors":  # a pickle: timm reads it with weights_only=True
        refuse_unsafe_torch("model.pretrained=true")
    try:
        native = timm.create_model(name, pretrained=True, pretrained_cfg_overlay={"file": str(path)})
    except Exception as error:  # a truncated or foreign file
        raise ConfigError(f"model.pretrained=true: {path} cannot be read ({_refusal(error)})") from error
    return native.state_dict(), f"{cfg.hf_hub_id or cfg.url} ({path})"


def _timm_cached(cfg: Any) -> tuple[Path | None, str]:
    """(the cached weights file of timm's pretrained `cfg`, or None; where it looked). Safetensors first, as timm's
    own loader prefers them."""
    if not cfg.hf_hub_id:
        path = hub_checkpoint(cfg.url)
        return (path if path.is_file() else None), str(path)
    needed_by = "model=timm model.pretrained=true"
    hub = optional.require("huggingface_hub", needed_by)
    cache = optional.require("huggingface_hub.constants", needed_by).HF_HUB_CACHE
    repo, _, revision = cfg.hf_hub_id.partition("@")
    for filename in [cfg.hf_hub_filename] if cfg.hf_hub_filename else ["model.safetensors", "pytorch_model.bin"]:
        found = hub.try_to_load_from_cache(repo, filename, cache_dir=cache, revision=revision or None)
        if isinstance(found, str):  # else None, or a marker that the file is known to be absent
            return Path(found), cache
    return None, os.path.join(cache, "models--" + repo.replace("/", "--"))


def torch_file(path: str) -> Any:
    """A file torch.save wrote, read without running code from it (weights_only)."""
    return torch.load(path, map_location="cpu", weights_only=True)


def read_weights(path: str, load: Callable[[str], Any] = torch_file) -> dict[str, torch.Tensor]:
    """The tensors of the weights file `path`: a state dict, or a checkpoint holding one under "model" (imgtrain's
    checkpoints) or "state_dict", wrappers' prefixes removed. `load` reads the file (timm's reader for model=timm:
    it also reads safetensors and prefers a checkpoint's EMA weights)."""
    path = os.path.expanduser(path)
    if not path.endswith(".safetensors"):  # a pickle, read with weights_only=True (torch's loader, or timm's)
        refuse_unsafe_torch(f"model.pretrained={path}")
    try:
        payload = load(path)
    except Exception as error:  # torch.load's ways to refuse a file vary: pickle, zip, EOF, a refused global
        raise ConfigError(
            f"model.pretrained={path} cannot be read as weights ({_refusal(error)}): expected a state dict (or a "
            "checkpoint holding one under 'model' or 'state_dict')"
        ) from error
    for key in ("model", "state_dict"):
        if isinstance(payload, dict) and isinstance(payload.get(key), dict):
            payload = payload[key]
    items = payload.items() if isinstance(payload, dict) else ()
    tensors = {_unwrapped(key): value for key, value in items if isinstance(value, torch.Tensor)}
    if not tensors:
        raise ConfigError(f"model.pretrained={path} holds no tensors: expected a state dict (or a checkpoint)")
    return tensors


def _unwrapped(key: str) -> str:
    for prefix in WRAPPER_PREFIXES:
        key = key.removeprefix(prefix)
    return key


def load_matching(model: nn.Module, state: dict[str, torch.Tensor], source: str, num_classes: int) -> None:
    """Copy into `model` each tensor of `state` whose name and shape it has; the log says what stayed at init."""
    own = model.state_dict()
    kept = {key: value for key, value in state.items() if key in own and value.shape == own[key].shape}
    if not kept:
        raise ConfigError(
            f"model.pretrained: none of the {len(state)} tensors of {source} fits {type(model).__name__} (no name "
            "with the same shape): are they this model's weights?"
        )
    model.load_state_dict(kept, strict=False)
    left = [key for key in own if key not in kept]
    named = ", ".join(left[:NAMED_AT_MOST]) + (
        f" and {len(left) - NAMED_AT_MOST} more" if len(left) > NAMED_AT_MOST else ""
    )
    foreign = sum(key not in own for key in state)
    log.info(
        "pretrained weights from %s: kept %d tensors; left %s at init for %d classes%s",
        source,
        len(kept),
        named or "none",
        num_classes,
        f"; {foreign} of its tensors have no place in this model" if foreign else "",
    )
