"""torchvision's CIFAR-10/100 as in-memory uint8 tensors, with one clear line when the files are missing offline."""

from __future__ import annotations

import os
import socket
from typing import Any

import numpy as np
import torch
from torchvision.datasets import CIFAR10, CIFAR100
from torchvision.transforms import v2

from imgtrain.common.errors import ConfigError
from imgtrain.config.datasets import AugmentPolicy
from imgtrain.data.datasets import (
    DatasetBundle,
    TensorImageDataset,
    augment_policy,
    policy_steps,
    square_resize,
    triple,
    with_steps,
)

DOWNLOAD_TIMEOUT_S = 20.0  # socket timeout for the CIFAR download, so an offline machine fails fast
CIFAR_FILES = {
    "cifar10": (CIFAR10, "cifar-10-python.tar.gz", "cifar-10-batches-py"),
    "cifar100": (CIFAR100, "cifar-100-python.tar.gz", "cifar-100-python"),
}


def build_cifar(
    name: str,
    image_size: int,
    mean: Any,
    std: Any,
    augment: str | bool,
    root: str,
    download: bool,
    randaugment_ops: int = 2,
    randaugment_magnitude: int = 9,
    random_erasing: float = 0.0,
) -> DatasetBundle:
    """torchvision's CIFAR-10/100 as uint8 tensors; a one-line ConfigError when the files are missing.

    Training: the CIFAR recipe's padded random crop and flip (batched, data/batched.py), then the policy of
    dataset.augment and random erasing (per sample: with either, the whole transform runs per sample)."""
    if name not in CIFAR_FILES:
        raise ConfigError(f"dataset.name={name} is invalid: accepted values are cifar10, cifar100")
    root = os.path.abspath(os.path.expanduser(root))
    train_set, val_set = (_load_cifar(name, root, train, download) for train in (True, False))
    resize = [] if image_size == 32 else [square_resize(image_size)]
    val_tf = resize[0] if resize else None
    keys = {"randaugment_ops": randaugment_ops, "randaugment_magnitude": randaugment_magnitude}
    tail = policy_steps(augment, random_erasing=random_erasing, mean=mean, **keys)
    if augment_policy(augment) == AugmentPolicy.none:
        train_tf = with_steps(val_tf, tail)
    else:
        train_tf = v2.Compose([v2.RandomCrop(32, padding=4), v2.RandomHorizontalFlip(), *resize, *tail])

    def wrap(ds: CIFAR10, transform: Any) -> TensorImageDataset:
        images = torch.from_numpy(np.ascontiguousarray(ds.data.transpose(0, 3, 1, 2)))  # NHWC -> NCHW
        return TensorImageDataset(images, np.asarray(ds.targets), ds.classes, transform)

    return DatasetBundle(
        train=wrap(train_set, train_tf),
        val=wrap(val_set, val_tf),
        num_classes=len(train_set.classes),
        image_size=image_size,
        mean=triple(mean),
        std=triple(std),
        name=name,
        classes=list(train_set.classes),
    )


def _load_cifar(name: str, root: str, train: bool, download: bool) -> CIFAR10:
    cls, archive, folder = CIFAR_FILES[name]
    previous = socket.getdefaulttimeout()
    socket.setdefaulttimeout(DOWNLOAD_TIMEOUT_S)
    try:
        return cls(root, train=train, download=download)
    except (OSError, RuntimeError) as err:  # URLError is an OSError; missing files with download=False
        why = "the download failed (offline?)" if download else "dataset.download=false"
        raise ConfigError(
            f"dataset={name}: no dataset files under {root} and {why}. Download {archive} from "
            f"https://www.cs.toronto.edu/~kriz/cifar.html and put it in {root}/ "
            f"(or extract it there as {folder}/)"
        ) from err
    finally:
        socket.setdefaulttimeout(previous)
