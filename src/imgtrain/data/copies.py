"""Host-to-device copies that never make the host wait for the GPU."""

from __future__ import annotations

import torch


def to_device(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """`tensor` on `device` without the host waiting: on CUDA from page-locked memory (pinned here if it is not),
    since a `non_blocking` copy from pageable memory waits for the kernels queued on the stream. On the CPU, the
    tensor itself."""
    if device.type == "cuda" and tensor.device.type == "cpu" and not tensor.is_pinned():
        tensor = tensor.pin_memory()
    return tensor.to(device, non_blocking=True)
