"""The augmentation policies of dataset.augment (TrivialAugmentWide, RandAugment, AutoAugment), drawn from each
sample's own uniforms instead of torch's process-global generator.

torchvision's policies draw their operation, magnitude bin and sign with `torch.randint`/`torch.rand` on the one
default CPU generator of the process. Seeding that generator per sample (what data/policies.py did) is exact only
while a single thread draws from it: loader threads (data.engine=threads) would interleave their draws. So each
policy's algorithm is repeated here draw for draw (torchvision/transforms/v2/_auto_augment.py, `forward`), with
each `torch.randint(n, ())` read as `floor(u * n)` and each `torch.rand(()) <= p` as `u <= p` from the sample's
counter stream (policies.uniforms), and the operation applied by the policy's own `_apply_image_or_video_transform`:
the same operations and magnitudes, on any thread, with no generator touched (tests/test_policy_draws.py patches
torch's draws with the same uniforms and compares with torchvision's forward, image for image).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from torchvision.transforms import v2

# Uniforms each policy reads per sample, at most: TrivialAugmentWide an operation, a bin and a sign; AutoAugment a
# sub-policy, then per operation of it (2) whether it applies and a sign; RandAugment an operation and a sign per op.
DRAWS_TRIVIAL = 3


def draws_of(step: Any) -> int | None:
    """How many uniforms `step` reads per sample; None for a transform this module does not draw for."""
    if isinstance(step, v2.TrivialAugmentWide):
        return DRAWS_TRIVIAL
    if isinstance(step, v2.AutoAugment):
        return 1 + 2 * max(len(sub_policy) for sub_policy in step._policies)
    if isinstance(step, v2.RandAugment):
        return 2 * step.num_ops
    return None


def _pick(u: float, count: int) -> int:
    """`torch.randint(count, ())` as a uniform in [0, 1) gives it."""
    return min(int(u * count), count - 1)


def _magnitude(step: Any, name: str, bins: int, index: int, u_sign: float, image: torch.Tensor) -> float:
    """Operation `name`'s magnitude at bin `index` of `bins`, negated on the sign draw when the operation is
    signed; 0 for an operation without magnitudes."""
    magnitudes_fn, signed = step._AUGMENTATION_SPACE[name]
    magnitudes = magnitudes_fn(bins, image.shape[-2], image.shape[-1])
    if magnitudes is None:
        return 0.0
    magnitude = float(magnitudes[index])
    return -magnitude if signed and u_sign <= 0.5 else magnitude


def _apply(step: Any, image: torch.Tensor, name: str, magnitude: float) -> torch.Tensor:
    return step._apply_image_or_video_transform(
        image, name, magnitude, interpolation=step.interpolation, fill=step._fill
    )


def _trivial(step: v2.TrivialAugmentWide, image: torch.Tensor, u: np.ndarray) -> torch.Tensor:
    names = tuple(step._AUGMENTATION_SPACE)
    name = names[_pick(u[0], len(names))]
    bins = step.num_magnitude_bins
    return _apply(step, image, name, _magnitude(step, name, bins, _pick(u[1], bins), u[2], image))


def _rand(step: v2.RandAugment, image: torch.Tensor, u: np.ndarray) -> torch.Tensor:
    names = tuple(step._AUGMENTATION_SPACE)
    for op in range(step.num_ops):
        name = names[_pick(u[2 * op], len(names))]
        magnitude = _magnitude(step, name, step.num_magnitude_bins, step.magnitude, u[2 * op + 1], image)
        image = _apply(step, image, name, magnitude)
    return image


def _auto(step: v2.AutoAugment, image: torch.Tensor, u: np.ndarray) -> torch.Tensor:
    sub_policy = step._policies[_pick(u[0], len(step._policies))]
    for op, (name, probability, bin_index) in enumerate(sub_policy):
        if not u[1 + 2 * op] <= probability:
            continue
        image = _apply(step, image, name, _magnitude(step, name, 10, bin_index, u[2 + 2 * op], image))
    return image


DRAWN = {v2.TrivialAugmentWide: _trivial, v2.RandAugment: _rand, v2.AutoAugment: _auto}


def apply_drawn(step: Any, image: torch.Tensor, u: np.ndarray) -> torch.Tensor:
    """`step` (a policy draws_of knows) on one uint8 image [3, H, W], its draws read from `u`."""
    draw = next(draw for kind, draw in DRAWN.items() if isinstance(step, kind))
    return draw(step, image, u)
