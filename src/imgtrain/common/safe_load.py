"""Which torch may read a pickle at all. torch.load(weights_only=True) runs no code from a file, except through the
known bypasses of its loader before torch 2.10; checkpoints and pretrained weights are both refused there."""

from __future__ import annotations

import re

import torch

SAFE_TORCH = (2, 10)  # the first torch whose weights_only loader has no known bypass


def torch_release() -> tuple[int, int]:
    major, minor = re.match(r"(\d+)\.(\d+)", torch.__version__).groups()
    return int(major), int(minor)


def unsafe_torch_reason() -> str | None:
    """Why this torch must not read a pickle (for "torch X cannot load it safely: <reason>"), or None."""
    if torch_release() >= SAFE_TORCH:
        return None
    return (
        f"its weights_only loader has known bypasses before {'.'.join(map(str, SAFE_TORCH))} (CVE-2025-32434, "
        "CVE-2026-24747); install torch>=2.10"
    )
