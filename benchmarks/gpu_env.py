"""gpu-check's first section, run as a process of its own (a CUDA start that hangs is cut by its limit): the
versions, the GPU, which optional packages load, and a few seconds of checks that the CUDA paths can start.
Prints one JSON line. Each probe that fails says why in one line; none stops the others. Also the checkout's
commit, for gpu_check.py's own process. Imports no torch until a probe runs.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import io
import json
import os
import platform
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

# distribution -> module: what train.py and the rows need, then the optional engines the GPU box lacks
REQUIRED = {"torch": "torch", "torchvision": "torchvision", "hydra-core": "hydra", "omegaconf": "omegaconf"}
REQUIRED |= {"tensorboard": "tensorboard", "psutil": "psutil", "nvidia-ml-py": "pynvml", "pytest": "pytest"}
OPTIONAL = {"torchcodec": "torchcodec.decoders", "timm": "timm", "matplotlib": "matplotlib", "litdata": "litdata"}
OPTIONAL |= {"boto3": "boto3", "optuna": "optuna", "nvidia-nvimgcodec-cu13": "nvidia.nvimgcodec"}
OPTIONAL |= {"simplejpeg": "simplejpeg", "torchdata": "torchdata"}


def _line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0]}" if text else type(error).__name__


def package(dist: str, module: str) -> dict[str, Any]:
    """Whether `module` imports here, its distribution's version and where it was found."""
    try:
        imported = importlib.import_module(module)
    except Exception as error:  # noqa: BLE001 - an import may fail with any error (a wheel for another torch)
        return {"loads": False, "why": _line(error)}
    try:
        version = importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        version = getattr(imported, "__version__", None)
    return {"loads": True, "version": version, "from": str(Path(getattr(imported, "__file__", "") or "").parent)}


def check(name: str, probe: Callable[[], str]) -> dict[str, Any]:
    """One check: ok with what it found, or not with its one-line reason."""
    try:
        return {"check": name, "ok": True, "detail": probe()}
    except Exception as error:  # noqa: BLE001 - every check reports, none stops the others
        return {"check": name, "ok": False, "detail": _line(error)}


def _bf16_matmul() -> str:
    import torch

    a = torch.ones(256, 256, device="cuda", dtype=torch.bfloat16)
    value = (a @ a).float().mean().item()
    if value != 256.0:
        raise RuntimeError(f"a 256x256 bf16 matmul of ones gave {value}, not 256")
    return "a bf16 matmul on the GPU gives the exact result"


def _nvjpeg() -> str:
    import numpy as np
    import torch
    from PIL import Image
    from torchvision.io import decode_jpeg

    buffer = io.BytesIO()
    Image.fromarray(np.full((48, 64, 3), 128, np.uint8)).save(buffer, "JPEG", quality=90)
    data = torch.frombuffer(bytearray(buffer.getvalue()), dtype=torch.uint8)
    image = decode_jpeg([data], device="cuda")[0]
    if tuple(image.shape) != (3, 48, 64):
        raise RuntimeError(f"nvJPEG decoded a 64x48 JPEG to {tuple(image.shape)}")
    return "torchvision's decode_jpeg(device='cuda') decodes a JPEG"


def _cpu_decoder() -> str:
    from imgtrain.data.decoders import cpu_decoder

    decoder = cpu_decoder("CPU decoding")
    why = f" (TorchCodec does not load: {decoder.fallback_reason})" if decoder.fallback_reason else ""
    return decoder.name + why


def machine() -> dict[str, Any]:
    """Python, torch, torchvision, CUDA, the GPU, its driver and the CPUs."""
    import torch
    import torchvision

    from imgtrain.host.cpus import available_cpus

    cuda = torch.cuda.is_available()
    found = {"python": platform.python_version(), "executable": sys.executable, "no_site": bool(sys.flags.no_site)}
    found |= {"torch": torch.__version__, "torchvision": torchvision.__version__, "cuda_available": cuda}
    found |= {"cuda": torch.version.cuda, "cpu_count": available_cpus(), "gpu": None, "driver": None, "cudnn": None}
    if cuda:
        props = torch.cuda.get_device_properties(0)
        found |= {"gpu": props.name, "gpu_memory_gb": props.total_memory / 1e9, "cudnn": torch.backends.cudnn.version()}
        try:
            from imgtrain.metrics.environment import driver_version

            found["driver"] = driver_version()
        except Exception as error:  # noqa: BLE001 - NVML missing or failing: said, not fatal
            found["driver"] = f"unknown: {_line(error)}"
    return found


def commit() -> str:
    """The checkout's commit (with "+changes" when the tree differs from it), or why it is unknown: the GPU box
    gets the tree without .git; pass --commit (make gpu-check GPU_CHECK_COMMIT=...) there."""
    env = {**os.environ, "GIT_OPTIONAL_LOCKS": "0"}  # read only: git writes nothing
    try:
        head = subprocess.run(["git", "rev-parse", "--short=10", "HEAD"], cwd=ROOT, env=env, capture_output=True,
                              text=True, timeout=10)  # fmt: skip
        if head.returncode != 0:
            return "unknown (no git repository here; pass --commit)"
        dirty = subprocess.run(["git", "diff", "--quiet", "HEAD", "--"], cwd=ROOT, env=env, timeout=10).returncode
        return head.stdout.strip() + (" +changes" if dirty else "")
    except (OSError, subprocess.TimeoutExpired) as error:
        return f"unknown ({type(error).__name__}; pass --commit)"


def main() -> int:
    started = time.perf_counter()
    packages = {dist: package(dist, module) for dist, module in {**REQUIRED, **OPTIONAL}.items()}
    missing = [dist for dist in REQUIRED if not packages[dist]["loads"]]
    checks = [{"check": "required packages load", "ok": not missing, "detail": ", ".join(missing) or "all"}]
    found = machine() if packages["torch"]["loads"] and packages["torchvision"]["loads"] else {}
    checks.append(check("CPU decoder", _cpu_decoder))
    if found.get("cuda_available"):
        checks += [check("bf16 on the GPU", _bf16_matmul), check("nvJPEG", _nvjpeg)]
    else:
        checks.append({"check": "CUDA", "ok": False, "detail": "torch.cuda.is_available() is False"})
    decoder = next(c for c in checks if c["check"] == "CPU decoder")
    found["cpu_decoder"] = decoder["detail"] if decoder["ok"] else f"none: {decoder['detail']}"
    seconds = round(time.perf_counter() - started, 1)
    print(json.dumps({"machine": found, "packages": packages, "checks": checks, "seconds": seconds}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
