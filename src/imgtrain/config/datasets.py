"""The dataset schemas: one per builder that `hydra.utils.instantiate` calls (`dataset=<name>`).

A schema defined here needs no registration: `dataset_schemas` finds every DatasetConfig, and its YAML file
(conf/dataset/<name>.yaml) names it as its base, `base_<its class name less Config, lowercase>`.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, ClassVar

from omegaconf import MISSING

from imgtrain.config.fields import AugmentOn, Choice, at_least, checked

IMAGENET_MEAN = [0.485, 0.456, 0.406]
IMAGENET_STD = [0.229, 0.224, 0.225]
# dataset.max_image_pixels' default: PIL's Image.MAX_IMAGE_PIXELS, the usual limit. A header may claim up to
# 65535 x 65535 (4.3 GP, 13 GB decoded) in a few hundred bytes; the decoders believe it.
MAX_IMAGE_PIXELS = 89_478_485


class AugmentPolicy(Choice):
    """The training augmentation (dataset.augment): a random resized crop and flip, then a per-sample policy from
    torchvision.transforms.v2 on the uint8 crop, as torchvision's classification reference applies them."""

    none = "none"  # no augmentation: the validation transform (resize, centre crop)
    rrc_flip = "rrc_flip"  # RandomResizedCrop and a horizontal flip (batched, data/batched.py)
    trivialaugment = "trivialaugment"  # and TrivialAugmentWide, per sample
    randaugment = "randaugment"  # and RandAugment(num_ops=dataset.randaugment_ops, magnitude=...), per sample
    autoaugment = "autoaugment"  # and AutoAugment's ImageNet policy, per sample


def _probability(value: float) -> str | None:
    return None if 0.0 <= value <= 1.0 else "expected a probability in [0, 1]"


class Decode(Choice):
    cpu = "cpu"  # workers decode
    cuda = "cuda"  # workers read bytes; the GPU decodes whole batches (nvJPEG)


class GpuDecoder(Choice):
    """What decodes with dataset.decode=cuda. The default stays torchvision's until a GPU measurement (make
    gpu-check's decoder part, benchmarks/gpu_decoders.py) says nvImageCodec's region decode is faster."""

    torchvision = "torchvision"  # decode_jpeg(device='cuda'): nvJPEG's hardware engine, whole images
    nvimgcodec = "nvimgcodec"  # nvImageCodec: only each sample's crop region; the gpu-decode extra


@dataclass
class DatasetConfig:
    """Fields every dataset has. `_target_` is the builder that `hydra.utils.instantiate` calls."""

    _target_: str = MISSING
    name: str = MISSING
    image_size: int = checked(64, at_least(8, note="pixels"))  # side of the square training crop
    mean: list[float] = field(default_factory=lambda: list(IMAGENET_MEAN))  # 0..1 units, applied on the device
    std: list[float] = field(default_factory=lambda: list(IMAGENET_STD))
    augment: AugmentPolicy = AugmentPolicy.rrc_flip  # none, rrc_flip, trivialaugment, randaugment, autoaugment
    randaugment_ops: int = checked(2, at_least(1, note="operations per image"))  # with augment=randaugment
    # RandAugment's strength of every operation, 0-30 (its num_magnitude_bins is 31); with augment=randaugment
    randaugment_magnitude: int = checked(9, lambda v: None if 0 <= v <= 30 else "expected an integer in [0, 30]")
    # per image, the chance of one random rectangle filled with the mean (torchvision's RandomErasing), per batch
    random_erasing: float = checked(0.0, _probability)
    extra: ClassVar[str | None] = None  # the optional engine it needs: imgtrain[<extra>] (host/optional.py)

    def augment_conflict(self, augment_on: AugmentOn, device_resident: bool) -> str | None:
        """Why dataset.augment or random_erasing cannot run where the data keys put it (one line), else None. A policy
        needs the crop in the workers; device-resident data and GPU decoding only crop and flip."""
        policy = self.augment not in (AugmentPolicy.none, AugmentPolicy.rrc_flip)
        asked = f"dataset.augment={self.augment}" if policy else f"dataset.random_erasing={self.random_erasing:g}"
        if policy and augment_on == AugmentOn.device:
            return (
                f"data.augment_on=device does not combine with {asked}: its operations run per image on the crop, "
                "in the workers. Use data.augment_on=auto or workers (or dataset.augment=rrc_flip, which with "
                "dataset.random_erasing can run on the device)"
            )
        if not policy and self.random_erasing == 0:
            return None
        plain = "or dataset.augment=rrc_flip dataset.random_erasing=0"
        if device_resident:
            return (
                f"data.device_resident=true crops and flips only, not {asked}: use data.device_resident=false, {plain}"
            )
        if getattr(self, "decode", Decode.cpu) == Decode.cuda:
            return f"dataset.decode=cuda crops and flips on the GPU only, not {asked}: use dataset.decode=cpu, {plain}"
        return None

    def files_problem(self) -> str | None:
        """Why the files this dataset reads are not there (one line), checked before any data is touched; else None."""
        return None


def dataset_schemas() -> dict[str, type[DatasetConfig]]:
    """Every dataset schema (DatasetConfig's subclasses, here and in any module imported), by the name its YAML file
    names as its base: ImageFolderConfig is base_imagefolder. `register_configs` stores them all."""
    found: dict[str, type[DatasetConfig]] = {}

    def add(parent: type[DatasetConfig]) -> None:
        for cls in parent.__subclasses__():
            found[f"base_{cls.__name__.removesuffix('Config').lower()}"] = cls
            add(cls)

    add(DatasetConfig)
    return found


@dataclass
class ShapesConfig(DatasetConfig):
    """Procedurally drawn shapes, generated once as JPEG files in an ImageFolder layout."""

    _target_: str = "imgtrain.data.datasets.build_shapes"
    name: str = "shapes"
    image_size: int = checked(32, at_least(8, note="pixels"))
    root: str = "${data_dir}/shapes"
    num_train: int = checked(5000, at_least(1))
    num_val: int = checked(1000, at_least(1))
    seed: int = 0
    mean: list[float] = field(default_factory=lambda: [0.5, 0.5, 0.5])
    std: list[float] = field(default_factory=lambda: [0.25, 0.25, 0.25])


@dataclass
class SyntheticConfig(DatasetConfig):
    """Random uint8 images held in memory: no decode cost, for compute-bound measurements."""

    _target_: str = "imgtrain.data.datasets.build_synthetic"
    name: str = "synthetic"
    num_train: int = checked(4096, at_least(1))
    num_val: int = checked(512, at_least(1))
    num_classes: int = checked(10, at_least(1))
    seed: int = 0


def _fraction(value: float) -> str | None:
    return None if 0.0 < value < 1.0 else "expected a fraction between 0 and 1"


@dataclass
class ImageFolderConfig(DatasetConfig):
    """Any ImageNet-style folder: root/train/<class>/*, root/val/<class>/*, or root/<class>/* plus a split."""

    _target_: str = "imgtrain.data.datasets.build_imagefolder"
    name: str = "imagefolder"
    root: str | None = None  # required
    val_fraction: float = checked(0.1, _fraction)  # used only when root has no val/ folder
    split_seed: int = 0
    image_size: int = checked(224, at_least(8, note="pixels"))
    val_resize: int | None = None  # null = val_image_size / 0.875, the usual ImageNet ratio
    # the validation centre crop, pixels; null = image_size. A recipe may train smaller than it tests, e.g.
    # torchvision's ResNet-50 recipe: 176-px training crops, 232-px resize, 224-px validation crops
    val_image_size: int | None = checked(None, at_least(8, note="pixels", null="image_size"))
    decode: Decode = Decode.cpu
    # with decode=cuda, what decodes: torchvision's until a GPU measurement chooses (make gpu-check's decoder part)
    gpu_decoder: GpuDecoder = GpuDecoder.torchvision
    # a file whose header claims more pixels is unreadable (counted against data.max_bad_samples), never decoded;
    # PIL's own guard follows it. Default: PIL's limit (89.5 MP); null = no limit
    max_image_pixels: int | None = checked(MAX_IMAGE_PIXELS, at_least(1, note="pixels", null="no limit"))
    # JPEGs decoded at 1/2, 1/4 or 1/8 scale (libjpeg-turbo, in the DCT domain) when the crop needs no more pixels:
    # for photos larger than the crops (docs/input-pipeline.md, "Big photos"); other files decode as before
    scaled_decode: bool = True

    def files_problem(self) -> str | None:
        if not self.root:
            return "dataset.root is required with dataset=imagefolder: pass dataset.root=/path/to/images"
        if not os.path.isdir(os.path.expanduser(self.root)):
            return f"dataset.root={self.root} is not a directory: point it at a folder of class folders"
        return None


@dataclass
class ShardsConfig(DatasetConfig):
    """An image folder packed by `imgtrain-shards SRC DST` (LitData shards), streamed from a directory or from
    S3-compatible object storage (s3://bucket/prefix; credentials and endpoint from the standard AWS variables)."""

    _target_: str = "imgtrain.data.shards.dataset.build_shards"
    extra: ClassVar[str | None] = "shards"  # LitData and boto3
    name: str = "shards"
    root: str | None = None  # required: the DST that imgtrain-shards wrote, a directory or s3://bucket/prefix
    image_size: int = checked(224, at_least(8, note="pixels"))
    val_resize: int | None = None  # null = val_image_size / 0.875, the usual ImageNet ratio
    # the validation centre crop, pixels; null = image_size. A recipe may train smaller than it tests, e.g.
    # torchvision's ResNet-50 recipe: 176-px training crops, 232-px resize, 224-px validation crops
    val_image_size: int | None = checked(None, at_least(8, note="pixels", null="image_size"))
    decode: Decode = Decode.cpu
    # with decode=cuda, what decodes: torchvision's until a GPU measurement chooses (make gpu-check's decoder part)
    gpu_decoder: GpuDecoder = GpuDecoder.torchvision
    # a file whose header claims more pixels is unreadable (counted against data.max_bad_samples), never decoded;
    # PIL's own guard follows it. Default: PIL's limit (89.5 MP); null = no limit
    max_image_pixels: int | None = checked(MAX_IMAGE_PIXELS, at_least(1, note="pixels", null="no limit"))
    # JPEGs decoded at 1/2, 1/4 or 1/8 scale (libjpeg-turbo, in the DCT domain) when the crop needs no more pixels:
    # for photos larger than the crops (docs/input-pipeline.md, "Big photos"); other files decode as before
    scaled_decode: bool = True
    # Object storage only: LitData keeps the chunks it fetches under cache_dir/<bucket>/<prefix>/<split>, on each
    # node, shared by the ranks there; cache_limit_gb caps that (null: LitData's default, 75% of the free disk
    # leaving at least 50 GB). Below the split's size, each chunk is deleted after use and fetched again next epoch.
    cache_dir: str = "${data_dir}/shard-cache"
    cache_limit_gb: float | None = checked(None, at_least(0.001, "GB", null="LitData's default"))
    timeout_s: float = checked(10.0, lambda v: None if v > 0 else "expected seconds > 0")  # per request, 2 tries

    def files_problem(self) -> str | None:
        if not self.root:
            return (
                "dataset.root is required with dataset=shards: pass dataset.root=<directory or s3://bucket/prefix> "
                "written by `imgtrain-shards <image folder> <destination>`"
            )
        if not self.root.startswith("s3://") and not os.path.isdir(os.path.expanduser(self.root)):
            return f"dataset.root={self.root} is not a directory: point it at what imgtrain-shards wrote"
        return None


@dataclass
class CifarConfig(DatasetConfig):
    """torchvision's CIFAR-10/100; downloaded on first use, with a clear message when offline."""

    _target_: str = "imgtrain.data.cifar.build_cifar"
    name: str = "cifar10"  # cifar10 or cifar100
    root: str = "${data_dir}/cifar"
    download: bool = True
    image_size: int = checked(32, at_least(8, note="pixels"))
    mean: list[float] = field(default_factory=lambda: [0.4914, 0.4822, 0.4465])
    std: list[float] = field(default_factory=lambda: [0.2470, 0.2435, 0.2616])


@dataclass
class CsvConfig(DatasetConfig):
    """A CSV (or TSV) per split of image path and label: paths relative to the file, classes from the labels."""

    _target_: str = "imgtrain.data.user_datasets.build_csv"
    name: str = "csv"
    train: str | None = None  # required: the training split's file
    val: str | None = None  # required: the validation split's file
    image_size: int = checked(224, at_least(8, note="pixels"))
    val_resize: int | None = None  # null = val_image_size / 0.875, the usual ImageNet ratio
    # the validation centre crop, pixels; null = image_size. A recipe may train smaller than it tests, e.g.
    # torchvision's ResNet-50 recipe: 176-px training crops, 232-px resize, 224-px validation crops
    val_image_size: int | None = checked(None, at_least(8, note="pixels", null="image_size"))
    # a file whose header claims more pixels is unreadable (counted against data.max_bad_samples), never decoded;
    # PIL's own guard follows it. Default: PIL's limit (89.5 MP); null = no limit
    max_image_pixels: int | None = checked(MAX_IMAGE_PIXELS, at_least(1, note="pixels", null="no limit"))
    # JPEGs decoded at 1/2, 1/4 or 1/8 scale (libjpeg-turbo, in the DCT domain) when the crop needs no more pixels:
    # for photos larger than the crops (docs/input-pipeline.md, "Big photos"); other files decode as before
    scaled_decode: bool = True

    def files_problem(self) -> str | None:
        for key in ("train", "val"):  # each split's CSV (data/csv_rows.py)
            file = getattr(self, key)
            if not file or not os.path.isfile(os.path.expanduser(file)):
                given = f"dataset.{key}={file} is not a file" if file else f"dataset.{key} is required with dataset=csv"
                return f"{given}: pass dataset.{key}=<a CSV or TSV of image path and label, one row per image>"
        return None


@dataclass
class CustomConfig(DatasetConfig):
    """Your own map-style Dataset (dataset=custom dataset._target_=your.module.YourDataset): the template calls
    it once per split with split="train" or "val" and the group's other keys (`options`), and wraps it with its
    guard, timing and batched crop. `validate` builds this from the group's keys; `dataset_class` is what
    `dataset._target_` named."""

    _target_: str = "imgtrain.data.user_datasets.build_custom"
    name: str = "custom"
    dataset_class: str = MISSING  # dataset._target_ on the command line
    num_classes: int | None = checked(None, at_least(1, null="from the dataset's `classes` attribute"))
    image_size: int = checked(224, at_least(8, note="pixels"))
    val_resize: int | None = None  # null = val_image_size / 0.875, the usual ImageNet ratio
    # the validation centre crop, pixels; null = image_size. A recipe may train smaller than it tests, e.g.
    # torchvision's ResNet-50 recipe: 176-px training crops, 232-px resize, 224-px validation crops
    val_image_size: int | None = checked(None, at_least(8, note="pixels", null="image_size"))
    # a file whose header claims more pixels is unreadable (counted against data.max_bad_samples), never decoded;
    # PIL's own guard follows it. Default: PIL's limit (89.5 MP); null = no limit
    max_image_pixels: int | None = checked(MAX_IMAGE_PIXELS, at_least(1, note="pixels", null="no limit"))
    options: dict[str, Any] = field(default_factory=dict)  # the group's other keys, passed to the constructor
