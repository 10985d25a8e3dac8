"""A dataset of your own, in one file or one class: `dataset=csv` (a CSV or TSV per split of image path and label,
read as data/csv_rows.py says) and `dataset=custom` (any map-style Dataset, by name). Both go through the same
worker path as the image folders: the guard for unreadable images (data.max_bad_samples), the stage timings and
the batched crop.
"""

from __future__ import annotations

import importlib
import inspect
import operator
import time
from typing import Any

import numpy as np
import torch
from PIL import Image
from torch.utils.data import IterableDataset

from imgtrain.common.errors import ConfigError, RunError, first_line
from imgtrain.config.datasets import MAX_IMAGE_PIXELS
from imgtrain.data import batched, decoders, stages
from imgtrain.data.csv_rows import csv_splits
from imgtrain.data.datasets import DatasetBundle, file_bundle
from imgtrain.data.decoders import DECODE_ERRORS, error_reason
from imgtrain.data.image_files import CorruptSampleError, DecodedSamples
from imgtrain.data.jpeg import too_many_pixels

# What the user's __getitem__ raises for an image it cannot read or decode, as the template's own decoders do (PIL:
# OSError, incl. UnidentifiedImageError and a missing file; SyntaxError for some broken PNGs; ValueError;
# TorchCodec and torchvision.io: RuntimeError; an image above dataset.max_image_pixels): the guard replaces or drops
# that sample. Any other exception is a bug in the user's code: the run ends in one line.
UNREADABLE = DECODE_ERRORS
# RuntimeErrors that say nothing about an image: a method left to implement, a recursion
NOT_IMAGE_ERRORS = (NotImplementedError, RecursionError)
# Pixel types a user's array or tensor may hold, scaled to uint8 as the decoders scale them (decoders.to_uint8)
ARRAY_TYPES = (np.uint8, np.uint16, np.float16, np.float32, np.float64)
TENSOR_TYPES = (torch.uint8, torch.uint16, torch.float16, torch.bfloat16, torch.float32, torch.float64)


def build_csv(train: str, val: str, **keys: Any) -> DatasetBundle:
    """dataset=csv: a CSV (or TSV) per split, read as data/csv_rows.py says; the images are decoded lazily by
    the workers, like an image folder's (`keys`: file_bundle's). `validate` has checked that both files exist."""
    return file_bundle(csv_splits(train, val), **keys)


# ----------------------------------------------------------------------------- your own Dataset class
class UserDataset(DecodedSamples):
    """The user's map-style Dataset as the template's workers use it: `decoded(index)` gives uint8 [3, H, W] and
    an int label (a PIL image converted to RGB, a grayscale tensor or array to 3 channels, 16-bit and float pixels
    scaled as the decoders scale them), with the whole user `__getitem__` timed as the decode stage (its read is
    inside it); `crop_spec` lets the batch be cropped in one call. An image it cannot read (UNREADABLE, an empty
    one, one above `max_pixels`: dataset.max_image_pixels, which PIL's own guard follows in the user's code)
    becomes a CorruptSampleError, which the guard replaces (training) or drops (validation) and counts against
    data.max_bad_samples; any other exception is a ConfigError naming the item, the exception's type and message.

    It pickles for spawn and forkserver workers when the user's class can be imported by its module path in a
    fresh process: defined in a module on PYTHONPATH (or an installed package), not in __main__ or a notebook.
    """

    def __init__(
        self, dataset: Any, transform: Any, classes: list[str], source: str, max_pixels: int | None = MAX_IMAGE_PIXELS
    ) -> None:
        self.dataset, self.transform, self.source, self.max_pixels = dataset, transform, source, max_pixels
        self.classes = list(classes)

    def __len__(self) -> int:
        return len(self.dataset)

    @property
    def crop_spec(self) -> batched.CropSpec | None:
        """The transform as one call for a whole batch (data/batched.py), or None (then per sample)."""
        return batched.spec_of(self.transform)

    def decoded(self, index: int, crop: Any = None) -> tuple[torch.Tensor, int]:
        """The item as uint8 [3, H, W] and its label; `crop` is not used: the user's code decodes its own files."""
        started = time.perf_counter()
        try:
            with decoders.pil_guard(self.max_pixels):  # an Image.open in the user's code refuses what we would
                item = self.dataset[index]
                pair = isinstance(item, tuple | list) and len(item) == 2
                image = self._image(item[0], index) if pair else None
        except RunError:
            raise
        except Exception as error:  # noqa: BLE001 - an unreadable image, or the user's bug: `_failed` says which
            raise self._failed(error, index) from (None if isinstance(error, UNREADABLE) else error)
        if not pair:
            raise ConfigError(f"dataset._target_={self.source}: item {index} is {_kind(item)}: expected (image, label)")
        stages.record(decode=time.perf_counter() - started)
        return image, self._label(item[1], index)

    def _failed(self, error: Exception, index: int) -> Exception:
        """An image the user's code could not read as a CorruptSampleError (named by the file when the error names
        one); any other exception, a bug in that code, as one line naming the item, the type and the message."""
        if isinstance(error, UNREADABLE) and not isinstance(error, NOT_IMAGE_ERRORS):
            where = getattr(error, "filename", None) or f"{self.source}[{index}]"
            return CorruptSampleError(str(where), error_reason(error))
        return ConfigError(
            f"dataset._target_={self.source}: __getitem__({index}) raised {type(error).__name__}: {first_line(error)}; "
            "fix the dataset's code (an image it cannot read should raise OSError: that is counted against "
            "data.max_bad_samples)"
        )

    def _image(self, image: Any, index: int) -> torch.Tensor:
        """uint8 [3, H, W] from a PIL image, or from pixels (uint8, 16-bit or float 0..1, decoders.to_uint8): a tensor
        [3 or 1, H, W] or [H, W], an array [H, W(, C)]. Empty or too large: a ValueError or OversizedImage."""
        if isinstance(image, Image.Image):
            self._check_size(*image.size, undecoded=bool(getattr(image, "tile", None)))  # tile: PIL's lazy open
            return decoders.pil_rgb(image)
        if isinstance(image, np.ndarray) and image.dtype in ARRAY_TYPES and image.ndim in (2, 3):
            image = torch.from_numpy(np.ascontiguousarray(image if image.ndim == 2 else image.transpose(2, 0, 1)))
        if isinstance(image, torch.Tensor) and image.dtype in TENSOR_TYPES and image.ndim in (2, 3):
            image = image[None] if image.ndim == 2 else image
            if image.shape[0] in (1, 3):
                self._check_size(image.shape[2], image.shape[1], undecoded=False)
                if image.dtype != torch.uint8:
                    pixels = image.float() if image.dtype == torch.bfloat16 else image  # NumPy has no bfloat16
                    image = torch.from_numpy(decoders.to_uint8(pixels.detach().numpy()))
                return image.repeat(3, 1, 1) if image.shape[0] == 1 else image
        raise ConfigError(
            f"dataset._target_={self.source}: item {index}'s image is {_kind(image)}: expected a PIL image, or "
            "[3, H, W] (or [H, W]) pixels: uint8 0-255, uint16 0-65535 or float 0-1; normalisation happens on the "
            "device (dataset.mean, dataset.std)"
        )

    def _check_size(self, width: int, height: int, undecoded: bool) -> None:
        """An empty image (whose crop would divide by zero) is a ValueError; one above max_pixels OversizedImage."""
        if width == 0 or height == 0:
            raise ValueError(f"an empty image of {width}x{height} pixels")
        too_large = too_many_pixels(width, height, self.max_pixels)
        if too_large:
            raise decoders.OversizedImage(
                f"{too_large}; not decoded" if undecoded else f"{too_large} (decoded by the dataset's code)"
            )

    def _label(self, label: Any, index: int) -> int:
        try:  # an int, a NumPy integer, an integer tensor of one element; not a bool (True is not class 1)
            boolean = isinstance(label, bool | np.bool_) or getattr(label, "dtype", None) == torch.bool
            value = None if boolean else operator.index(label)
        except TypeError:
            value = None
        if value is None or not 0 <= value < len(self.classes):
            raise ConfigError(
                f"dataset._target_={self.source}: item {index}'s label is {label!r}: expected an int class index in "
                f"0..{len(self.classes) - 1} ({len(self.classes)} classes)"
            )
        return value


def _kind(value: Any) -> str:
    if isinstance(value, torch.Tensor | np.ndarray):
        return f"a {type(value).__name__} of {value.dtype} {list(value.shape)}"
    return f"a {type(value).__name__}"


def import_dataset_class(path: str) -> Any:
    """The class `dataset._target_` names (module.Class); one ConfigError if it cannot be imported or used."""
    module_name, _, attr = path.rpartition(".")
    where = f"dataset._target_={path}"
    if not module_name:
        raise ConfigError(f"{where}: expected a module path and a class, e.g. my_pkg.datasets.MyDataset")
    try:
        module = importlib.import_module(module_name)
    except ImportError as error:
        raise ConfigError(
            f"{where}: module {module_name} cannot be imported ({first_line(error)}): put its folder on PYTHONPATH "
            "or install its package"
        ) from None
    found = getattr(module, attr, None)
    if found is None or not callable(found):
        what = f"has no {attr}" if found is None else f"holds a {type(found).__name__} as {attr}, not a class"
        raise ConfigError(f"{where}: module {module_name} {what}: expected a map-style Dataset class")
    if isinstance(found, type) and issubclass(found, IterableDataset):
        raise ConfigError(f"{where} is an IterableDataset: dataset=custom takes a map-style one (__len__, __getitem__)")
    return found


def construct(cls: Any, path: str, split: str, options: dict[str, Any]) -> Any:
    """cls(split=split, **options), checked against its signature first: a parameter it lacks, or one it needs
    and was not given, is one line listing the parameters it takes."""
    where, kwargs = f"dataset._target_={path}", {"split": split, **options}
    try:
        signature = inspect.signature(cls)
    except (TypeError, ValueError):  # a builtin without one: let the call itself say
        signature = None
    try:
        if signature is not None:
            signature.bind(**kwargs)
    except TypeError as error:
        given = ", ".join(f"{key}={value!r}" for key, value in kwargs.items())
        takes = ", ".join(str(p.replace(annotation=p.empty)) for p in signature.parameters.values())
        raise ConfigError(
            f"{where} cannot be called as ({given}): {error}; it takes ({takes}), and dataset=custom passes "
            "split='train'|'val' and each +dataset.<key>=<value>"
        ) from None
    try:
        dataset = cls(**kwargs)
    except OSError as error:  # its files are not where its arguments say
        raise ConfigError(f"{where}(split={split!r}) cannot open its data: {first_line(error)}") from None
    if not (hasattr(dataset, "__len__") and hasattr(dataset, "__getitem__")) or isinstance(dataset, IterableDataset):
        raise ConfigError(f"{where}: a {type(dataset).__name__} is not a map-style Dataset (__len__, __getitem__)")
    if len(dataset) == 0:
        raise ConfigError(f"{where}(split={split!r}) has no items")
    return dataset


def dataset_classes(train: Any, val: Any, path: str, num_classes: int | None) -> list[str]:
    """The class names: the training dataset's `classes` (torchvision's convention), or dataset.num_classes."""
    where = f"dataset._target_={path}"
    named = getattr(train, "classes", None)
    named = [str(name) for name in named] if named is not None else None
    if not named and num_classes is None:
        raise ConfigError(
            f"{where} has no `classes` attribute: give it one (the class names) or pass dataset.num_classes=N"
        )
    if named and num_classes is not None and len(named) != num_classes:
        raise ConfigError(f"dataset.num_classes={num_classes} but {where} has {len(named)} classes: drop one of them")
    val_named = getattr(val, "classes", None)
    if named and val_named is not None and [str(name) for name in val_named] != named:
        raise ConfigError(f"{where}: split='val' has other `classes` than split='train': a label must mean one class")
    return named or [str(i) for i in range(num_classes)]


def build_custom(
    name: str,
    image_size: int,
    mean: Any,
    std: Any,
    augment: Any,
    randaugment_ops: int,
    randaugment_magnitude: int,
    random_erasing: float,
    dataset_class: str,
    num_classes: int | None,
    val_resize: int | None,
    options: dict[str, Any],
    val_image_size: int | None = None,
    max_image_pixels: int | None = MAX_IMAGE_PIXELS,
) -> DatasetBundle:
    """dataset=custom: `dataset_class` (dataset._target_) called once per split, split="train" or "val" with the
    group's other keys (`options`), each wrapped in a UserDataset; the classes from its `classes` or num_classes."""
    cls = import_dataset_class(dataset_class)
    train_set, val_set = (construct(cls, dataset_class, split, dict(options)) for split in ("train", "val"))
    classes = dataset_classes(train_set, val_set, dataset_class, num_classes)

    def user(split: Any, transform: Any) -> UserDataset:
        return UserDataset(split, transform, classes, dataset_class, max_image_pixels)

    keys = {"randaugment_ops": randaugment_ops, "randaugment_magnitude": randaugment_magnitude}
    keys |= {"augment": augment, "random_erasing": random_erasing, "mean": mean, "std": std}
    sizes = {"image_size": image_size, "val_resize": val_resize, "val_image_size": val_image_size}
    return file_bundle((train_set, val_set, classes), name=name, dataset=user, **sizes, **keys)
