"""Dataset builders: each returns a DatasetBundle whose items are (uint8 tensor [3, S, S], int label).

A builder is the `_target_` of its schema (config/datasets.py), which `hydra.utils.instantiate` calls with the
schema's keys: one that reads image files lists them and hands the rest to `file_bundle`, one that holds its images
in memory to `tensor_bundle`. The datasets themselves: data/image_files.py, data/in_memory.py.
Workers only decode and augment uint8 tensors; conversion to float and normalisation with `mean`/`std`
happen on the device in the training loop (4x less shared-memory traffic than float32 batches).
Every transform is a module-level torchvision object, so datasets pickle for spawn and forkserver workers.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils.data import Dataset
from torchvision.transforms import v2

from imgtrain.config.datasets import IMAGENET_MEAN, MAX_IMAGE_PIXELS, AugmentPolicy
from imgtrain.data import decoders, shapes
from imgtrain.data.folders import folder_splits, list_images
from imgtrain.data.image_files import EncodedFileDataset, ImageFileDataset
from imgtrain.data.in_memory import TensorImageDataset


@dataclass
class DatasetBundle:
    """Train and val datasets plus what the model and the on-device normalisation need."""

    train: Dataset
    val: Dataset
    num_classes: int
    image_size: int
    mean: tuple[float, float, float]  # 0..1 units; applied on the device, after the uint8 batch arrives
    std: tuple[float, float, float]
    name: str
    classes: list[str] = field(default_factory=list)


# ----------------------------------------------------------------------------- transforms
def augment_policy(augment: str | bool) -> AugmentPolicy:
    """dataset.augment as an AugmentPolicy. A bool is the former key's value, from code that builds a dataset
    directly: true is rrc_flip, false none."""
    if isinstance(augment, bool):
        return AugmentPolicy.rrc_flip if augment else AugmentPolicy.none
    return AugmentPolicy(augment)


def policy_steps(
    augment: str | bool,
    *,
    randaugment_ops: int = 2,
    randaugment_magnitude: int = 9,
    random_erasing: float = 0.0,
    mean: Any = IMAGENET_MEAN,
) -> list[Any]:
    """What follows the crop and flip, on the uint8 crop, in torchvision's classification reference's order: the
    policy of `augment`, then RandomErasing with the dataset's mean (in 0..255 levels: after normalisation, about
    0, what the reference gets by erasing with 0 after Normalize)."""
    augment = augment_policy(augment)
    steps: list[Any] = []
    if augment == AugmentPolicy.trivialaugment:
        steps.append(v2.TrivialAugmentWide())
    elif augment == AugmentPolicy.randaugment:
        steps.append(v2.RandAugment(num_ops=randaugment_ops, magnitude=randaugment_magnitude))
    elif augment == AugmentPolicy.autoaugment:
        steps.append(v2.AutoAugment(v2.AutoAugmentPolicy.IMAGENET))
    if random_erasing > 0:
        steps.append(v2.RandomErasing(p=random_erasing, value=mean_levels(mean)))
    return steps


def mean_levels(mean: Any) -> list[int]:
    """The mean (0..1 units) as the uint8 levels a worker can write."""
    return [round(255 * float(m)) for m in mean]


def train_transform(
    image_size: int,
    min_scale: float = 0.35,
    *,
    augment: str | bool = AugmentPolicy.rrc_flip,
    randaugment_ops: int = 2,
    randaugment_magnitude: int = 9,
    random_erasing: float = 0.0,
    mean: Any = IMAGENET_MEAN,
) -> v2.Compose:
    """Random crop of min_scale-100% of the area resized to image_size, a random horizontal flip, then the policy of
    `augment` and random erasing (`policy_steps`). The crop and flip run batched, the policy per sample after them,
    the erasing per batch (data/batched.py, data/policies.py)."""
    tail = policy_steps(
        augment,
        randaugment_ops=randaugment_ops,
        randaugment_magnitude=randaugment_magnitude,
        random_erasing=random_erasing,
        mean=mean,
    )
    crop = v2.RandomResizedCrop(image_size, scale=(min_scale, 1.0), antialias=True)
    return v2.Compose([crop, v2.RandomHorizontalFlip(), *tail])


def eval_transform(image_size: int, resize: int | None = None) -> v2.Compose:
    """Resize the short side to `resize` (default image_size / 0.875), then a centre crop of image_size."""
    return v2.Compose([v2.Resize(resize or int(image_size / 0.875), antialias=True), v2.CenterCrop(image_size)])


def imagenet_transforms(
    image_size: int,
    val_resize: int | None = None,
    augment: str | bool = AugmentPolicy.rrc_flip,
    *,
    randaugment_ops: int = 2,
    randaugment_magnitude: int = 9,
    random_erasing: float = 0.0,
    mean: Any = IMAGENET_MEAN,
    val_image_size: int | None = None,
) -> tuple[Any, Any]:
    """(training, validation) transforms of the ImageNet-style datasets (imagefolder, shards, csv, custom): training
    crops of image_size, validation's of val_image_size (None: image_size). augment=none trains on the validation
    transform at image_size (then random erasing, if asked)."""
    keys = {"randaugment_ops": randaugment_ops, "randaugment_magnitude": randaugment_magnitude}
    val_tf = eval_transform(val_image_size or image_size, val_resize)
    untouched = val_tf if val_image_size in (None, image_size) else eval_transform(image_size, val_resize)
    train_tf = training_transform(image_size, untouched, augment, random_erasing=random_erasing, mean=mean, **keys)
    return train_tf, val_tf


def training_transform(size: int, untouched: Any, augment: str | bool, min_scale: float = 0.35, **keys: Any) -> Any:
    """`train_transform` with `keys` (policy_steps'), or with augment=none the `untouched` transform (the
    validation one), followed by random erasing when asked."""
    if augment_policy(augment) == AugmentPolicy.none:
        return with_steps(untouched, policy_steps(augment, **keys))
    return train_transform(size, min_scale, augment=augment, **keys)


def with_steps(transform: Any, steps: list[Any]) -> Any:
    """`transform` (a Compose, one transform or None) followed by `steps`; itself when there are none."""
    if not steps:
        return transform
    head = list(transform.transforms) if isinstance(transform, v2.Compose) else [] if transform is None else [transform]
    return v2.Compose([*head, *steps])


def square_resize(image_size: int) -> v2.Resize:
    return v2.Resize((image_size, image_size), antialias=True)  # a no-op when the size already matches


# ----------------------------------------------------------------------------- the bundles builders return
Split = tuple[list[str], list[int]]  # one split of image files: their paths and labels


def bundle(
    train: Dataset, val: Dataset, classes: list[str], *, name: str, image_size: int, mean: Any, std: Any
) -> DatasetBundle:
    """The DatasetBundle of a training and a validation dataset and their class names."""
    return DatasetBundle(train, val, len(classes), image_size, triple(mean), triple(std), name, list(classes))


def file_bundle(
    listing: tuple[Any, Any, list[str]],
    *,
    name: str,
    image_size: int,
    mean: Any,
    std: Any,
    decode: str | None = None,
    gpu_decoder: str | None = None,  # with decode=cuda, the feed's choice (data/region_decode.py), not the dataset's
    max_image_pixels: int | None = MAX_IMAGE_PIXELS,
    scaled_decode: bool = False,
    transforms: tuple[Any, Any] | None = None,
    dataset: Callable[[Any, Any], Dataset] | None = None,
    **keys: Any,
) -> DatasetBundle:
    """The builder of every dataset that reads image files: its own builder lists (train, val, classes), each split
    a `Split`, and passes its schema's other keys on, `return file_bundle(my_listing(root), **keys)`.

    The transforms: `transforms` (train, val), or `imagenet_transforms` of `keys` (augment, val_resize,
    val_image_size, randaugment_ops, randaugment_magnitude, random_erasing). The workers read and decode the files
    (after a check that a CPU decoder exists; decode=None: the dataset has no dataset.decode key), or with
    decode="cuda" read them as bytes for the GPU to decode; `scaled_decode`: JPEGs at reduced scale where the crop
    allows (data/scaled_decode.py). `dataset(split, transform)`: each split's Dataset when
    a split is not image files (dataset=custom: the user's Dataset)."""
    train, val, classes = listing
    train_tf, val_tf = transforms or imagenet_transforms(image_size, mean=triple(mean), **keys)
    if dataset is None:
        dataset = _file_dataset(name, decode, max_image_pixels, classes, scaled_decode)
    return bundle(dataset(train, train_tf), dataset(val, val_tf), classes, **_bundle_keys(name, image_size, mean, std))


def _file_dataset(name: str, decode: str | None, max_pixels: int | None, classes: list[str], scaled: bool) -> Callable:
    """How a `Split` and its transform become a Dataset of image files."""
    if decode == "cuda":  # nvJPEG decodes on the GPU: no CPU decoder needed
        return lambda split, transform: EncodedFileDataset(*split, classes, transform, max_pixels)
    decoders.check(f"dataset={name}", "" if decode is None else "use dataset.decode=cuda on a GPU")
    return lambda split, transform: ImageFileDataset(*split, classes, transform, max_pixels, scaled)


def tensor_bundle(
    train: tuple[torch.Tensor, Any],
    val: tuple[torch.Tensor, Any],
    classes: list[str],
    *,
    name: str,
    image_size: int,
    mean: Any,
    std: Any,
    **keys: Any,
) -> DatasetBundle:
    """The builder of every dataset held in memory: (uint8 images [N, 3, S, S], N labels) per split. No crop or flip;
    the policy of dataset.augment and random erasing per training sample (`policy_steps` of `keys`: augment,
    randaugment_ops, randaugment_magnitude, random_erasing)."""
    train_set = TensorImageDataset(*train, classes, with_steps(None, policy_steps(mean=mean, **keys)))
    return bundle(train_set, TensorImageDataset(*val, classes), classes, **_bundle_keys(name, image_size, mean, std))


def _bundle_keys(name: str, image_size: int, mean: Any, std: Any) -> dict[str, Any]:
    """The schema's keys that `bundle` takes, besides the datasets."""
    return {"name": name, "image_size": image_size, "mean": mean, "std": std}


# ----------------------------------------------------------------------------- the template's datasets
def build_shapes(
    name: str,
    image_size: int,
    mean: Any,
    std: Any,
    augment: str | bool,
    root: str,
    num_train: int,
    num_val: int,
    seed: int,
    randaugment_ops: int = 2,
    randaugment_magnitude: int = 9,
    random_erasing: float = 0.0,
) -> DatasetBundle:
    """The default dataset: shapes generated once as JPEGs, then read like any image folder."""
    # before generating: the generator writes with PIL, training decodes
    decoders.check(f"dataset={name}", alternative="use dataset=synthetic")
    base = shapes.ensure_shapes(root, image_size, num_train, num_val, seed)
    class_to_idx = {c: i for i, c in enumerate(sorted(shapes.CLASSES))}  # all 10, even with tiny splits
    train_paths, train_labels, classes = list_images(os.path.join(base, "train"), class_to_idx)
    val_paths, val_labels, _ = list_images(os.path.join(base, "val"), class_to_idx)
    # Milder crops than ImageNet's: one object fills the frame, and a small crop could cut it out.
    keys = {"randaugment_ops": randaugment_ops, "randaugment_magnitude": randaugment_magnitude}
    keys |= {"random_erasing": random_erasing, "mean": mean}
    train_tf = training_transform(image_size, square_resize(image_size), augment, min_scale=0.6, **keys)
    listing = ((train_paths, train_labels), (val_paths, val_labels), classes)
    transforms = (train_tf, square_resize(image_size))
    return file_bundle(listing, transforms=transforms, **_bundle_keys(name, image_size, mean, std))


def build_synthetic(
    name: str,
    image_size: int,
    mean: Any,
    std: Any,
    augment: str | bool,
    num_train: int,
    num_val: int,
    num_classes: int,
    seed: int,
    randaugment_ops: int = 2,
    randaugment_magnitude: int = 9,
    random_erasing: float = 0.0,
) -> DatasetBundle:
    """Random uint8 images and labels held in memory: measures compute without any decode cost. No crop or flip; a
    policy and random erasing (dataset.augment, dataset.random_erasing) apply per sample, to time them alone."""
    gen = torch.Generator().manual_seed(seed)

    def make(n: int) -> tuple[torch.Tensor, Any]:
        images = torch.randint(0, 256, (n, 3, image_size, image_size), generator=gen, dtype=torch.uint8)
        return images, torch.randint(0, num_classes, (n,), generator=gen).numpy()

    keys = {"randaugment_ops": randaugment_ops, "randaugment_magnitude": randaugment_magnitude}
    keys |= {"augment": augment, "random_erasing": random_erasing}
    classes = [f"class_{i}" for i in range(num_classes)]
    return tensor_bundle(make(num_train), make(num_val), classes, **_bundle_keys(name, image_size, mean, std), **keys)


def build_imagefolder(
    root: str | None, val_fraction: float, split_seed: int, decode: str = "cpu", **keys: Any
) -> DatasetBundle:
    """root/train/<class>/* and root/val/<class>/*, or root/<class>/* split by val_fraction (data/folders.py);
    `keys`: file_bundle's. `validate` has checked that root is a directory; the layout is checked here."""
    root = os.path.abspath(os.path.expanduser(root))
    return file_bundle(folder_splits(root, val_fraction, split_seed), decode=decode, **keys)


def triple(values: Any) -> tuple[float, float, float]:
    a, b, c = (float(v) for v in values)
    return a, b, c
