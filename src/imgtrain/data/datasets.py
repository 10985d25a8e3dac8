"""Dataset builders: each returns a DatasetBundle whose items are (uint8 tensor [3, S, S], int label).

Workers only decode and augment uint8 tensors; conversion to float and normalisation with `mean`/`std`
happen on the device in the training loop (4x less shared-memory traffic than float32 batches).
Every transform is a module-level torchvision object, so datasets pickle for spawn and forkserver workers.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import torchvision.transforms.v2.functional as F
from torch.utils.data import Dataset
from torchvision.transforms import v2

from imgtrain.config.datasets import IMAGENET_MEAN, MAX_IMAGE_PIXELS, AugmentPolicy
from imgtrain.data import batched, decoders, shapes, stages
from imgtrain.data.decoders import DECODE_ERRORS, decode_bytes, error_reason, read_file
from imgtrain.data.folders import folder_splits, list_images
from imgtrain.data.jpeg import EncodedJpeg, jpeg_problem


class CorruptSampleError(Exception):
    """An image file that cannot be read or decoded: its path and why; the message is "path: reason"."""

    def __init__(self, path: str, reason: str = "") -> None:  # one argument: how DataLoader re-raises it
        super().__init__(f"{path}: {reason}" if reason else path)
        self.path, self.reason = path, reason


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
    val_resize: int | None,
    augment: str | bool,
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


# ----------------------------------------------------------------------------- datasets
class ImageFileDataset(Dataset):
    """Lazily decoded image files with integer labels, shared by `shapes`, `imagefolder` and `csv`. A file whose
    header claims more than `max_pixels` pixels (dataset.max_image_pixels; None: no limit) is unreadable."""

    def __init__(
        self,
        paths: list[str],
        labels: list[int],
        classes: list[str],
        transform: Any,
        max_pixels: int | None = MAX_IMAGE_PIXELS,
    ) -> None:
        # numpy arrays, not a list of (path, label) tuples: each worker touching refcounted python objects
        # would copy their pages (copy-on-write), multiplying RAM by num_workers + 1. Bytes, not np.str_,
        # which stores 4 bytes per character.
        self.paths = np.array([os.fsencode(p) for p in paths], dtype=np.bytes_)
        self.labels = np.array(labels, dtype=np.int64)
        self.classes = list(classes)
        self.transform = transform
        self.max_pixels = max_pixels

    def __len__(self) -> int:
        return len(self.paths)

    def path(self, index: int) -> str:
        """The file behind item `index`."""
        return os.fsdecode(self.paths[index])

    @property
    def crop_spec(self) -> batched.CropSpec | None:
        """The transform as one call for a whole batch (data/batched.py), or None: then each sample is transformed
        on its own by `__getitem__`."""
        return batched.spec_of(self.transform)

    def decoded(self, index: int) -> tuple[torch.Tensor, int]:
        """Item `index` read and decoded, not transformed: uint8 [3, H, W] and its label (read and decode timed)."""
        path = self.path(index)
        started = time.perf_counter()
        try:
            data = read_file(path)
            read = time.perf_counter()
            raw = decode_bytes(data, path, self.max_pixels)
        except DECODE_ERRORS as error:
            raise CorruptSampleError(path, error_reason(error)) from None
        stages.record(read - started, time.perf_counter() - read)
        return raw, int(self.labels[index])

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        raw, label = self.decoded(index)
        read, decode, _ = stages.take()
        started = time.perf_counter()
        image = self.transform(raw).contiguous()
        stages.record(read, decode, time.perf_counter() - started)
        return image, label


class EncodedFileDataset(ImageFileDataset):
    """JPEG files as undecoded bytes (dataset.decode=cuda): the training process decodes whole batches on the
    GPU and applies `transform` there, so workers only read files (and check their markers and size)."""

    crop_spec = None  # the GPU decodes and transforms whole batches (data/gpu_decode.py)

    def __getitem__(self, index: int) -> tuple[EncodedJpeg, int]:
        path = self.path(index)
        started = time.perf_counter()
        try:
            with open(path, "rb") as f:
                raw = bytearray(f.read())
        except OSError as error:
            raise CorruptSampleError(path, str(error.strerror or error)) from None
        problem = jpeg_problem(raw, self.max_pixels)
        if problem:
            raise CorruptSampleError(path, problem)
        stages.record(read=time.perf_counter() - started)  # decoding is timed on the GPU (gpu_decode)
        return EncodedJpeg(torch.frombuffer(raw, dtype=torch.uint8), path), int(self.labels[index])


class TensorImageDataset(Dataset):
    """Images already in memory as one uint8 tensor [N, 3, H, W], with an optional transform."""

    def __init__(self, images: torch.Tensor, labels: np.ndarray, classes: list[str], transform: Any = None):
        self.images = images
        self.labels = np.asarray(labels, dtype=np.int64)
        self.classes = list(classes)
        self.transform = transform

    def __len__(self) -> int:
        return len(self.labels)

    @property
    def batchable(self) -> bool:
        """Whether `batch_items` can transform a whole batch at once (the transforms CIFAR and synthetic use)."""
        return _tensor_batch_steps(self.transform, self.images.shape[-1]) is not None

    def batch_items(self, indices: list[int], seeds: list[int], timed: bool) -> list[tuple]:
        """A batch's samples at once, as GuardedSamples gives them: one gather, then the transform applied to the
        batch (CIFAR's padded crop and flip drawn from each sample's seed, data/batched.py) instead of per image."""
        started = time.perf_counter()
        pad, size = _tensor_batch_steps(self.transform, self.images.shape[-1])
        images = self.images[torch.as_tensor(indices)]
        if pad is not None:
            images = batched.pad_crop_flip(images, torch.as_tensor(seeds, dtype=torch.int64), pad)
        if size is not None and size != images.shape[-1]:
            images = F.resize(images, [size, size], antialias=True)
        share = (time.perf_counter() - started) / len(indices)
        times = (0.0, 0.0, share, share) if timed else None  # in memory: nothing to read or decode
        return [(image, int(label), (), times) for image, label in zip(images, self.labels[indices], strict=True)]

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        started = time.perf_counter()
        image = self.images[index]
        if self.transform is not None:
            image = self.transform(image)
        image = image.contiguous()
        stages.record(augment=time.perf_counter() - started)  # in memory: nothing to read or decode
        return image, int(self.labels[index])


def _tensor_batch_steps(transform: Any, side: int) -> tuple[int | None, int | None] | None:
    """(padding of a random crop with flip, square resize side) when `transform` is one of those CIFAR and
    synthetic use: none, a square Resize, or RandomCrop(side, padding) + RandomHorizontalFlip(0.5) [+ Resize]."""
    steps = (
        list(transform.transforms) if isinstance(transform, v2.Compose) else [] if transform is None else [transform]
    )
    size = None
    if steps and isinstance(steps[-1], v2.Resize) and batched.square_bilinear_resize(steps[-1]):
        size = steps.pop().size[0]
    if not steps:
        return None, size
    if len(steps) == 2 and isinstance(steps[0], v2.RandomCrop) and isinstance(steps[1], v2.RandomHorizontalFlip):
        crop, flip = steps
        padding = crop.padding
        even = isinstance(padding, int) or (padding is not None and len(set(padding)) == 1)
        zeros = crop.padding_mode == "constant" and crop.fill in (0, {})
        if list(crop.size) == [side, side] and even and zeros and flip.p == 0.5:
            return (padding if isinstance(padding, int) else padding[0]), size
    return None


# ----------------------------------------------------------------------------- listing image folders
# ----------------------------------------------------------------------------- builders
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
    return DatasetBundle(
        train=ImageFileDataset(train_paths, train_labels, classes, train_tf),
        val=ImageFileDataset(val_paths, val_labels, classes, square_resize(image_size)),
        num_classes=len(classes),
        image_size=image_size,
        mean=triple(mean),
        std=triple(std),
        name=name,
        classes=classes,
    )


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
    classes = [f"class_{i}" for i in range(num_classes)]

    def make(n: int, transform: Any = None) -> TensorImageDataset:
        images = torch.randint(0, 256, (n, 3, image_size, image_size), generator=gen, dtype=torch.uint8)
        labels = torch.randint(0, num_classes, (n,), generator=gen).numpy()
        return TensorImageDataset(images, labels, classes, transform)

    keys = {"randaugment_ops": randaugment_ops, "randaugment_magnitude": randaugment_magnitude}
    train = make(num_train, with_steps(None, policy_steps(augment, random_erasing=random_erasing, mean=mean, **keys)))
    return DatasetBundle(train, make(num_val), num_classes, image_size, triple(mean), triple(std), name, classes)


def build_imagefolder(
    name: str,
    image_size: int,
    mean: Any,
    std: Any,
    augment: str | bool,
    root: str | None,
    val_fraction: float,
    split_seed: int,
    val_resize: int | None,
    decode: str = "cpu",
    randaugment_ops: int = 2,
    randaugment_magnitude: int = 9,
    random_erasing: float = 0.0,
    val_image_size: int | None = None,
    max_image_pixels: int | None = MAX_IMAGE_PIXELS,
) -> DatasetBundle:
    """root/train/<class>/* and root/val/<class>/*, or root/<class>/* split by val_fraction.

    `validate` has checked that root is a directory; the layout is checked here.
    """
    root = os.path.abspath(os.path.expanduser(root))
    (train_paths, train_labels), (val_paths, val_labels), classes = folder_splits(root, val_fraction, split_seed)
    train_tf, val_tf = imagenet_transforms(
        image_size,
        val_resize,
        augment,
        randaugment_ops=randaugment_ops,
        randaugment_magnitude=randaugment_magnitude,
        random_erasing=random_erasing,
        mean=triple(mean),
        val_image_size=val_image_size,
    )
    if decode != "cuda":  # nvJPEG decodes on the GPU: no CPU decoder needed
        decoders.check(f"dataset={name}", alternative="use dataset.decode=cuda on a GPU")
    files = EncodedFileDataset if decode == "cuda" else ImageFileDataset
    return DatasetBundle(
        train=files(train_paths, train_labels, classes, train_tf, max_image_pixels),
        val=files(val_paths, val_labels, classes, val_tf, max_image_pixels),
        num_classes=len(classes),
        image_size=image_size,
        mean=triple(mean),
        std=triple(std),
        name=name,
        classes=classes,
    )


def triple(values: Any) -> tuple[float, float, float]:
    a, b, c = (float(v) for v in values)
    return a, b, c
