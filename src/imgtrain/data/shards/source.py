"""What `imgtrain-shards` packs: an image folder, split as `dataset=imagefolder` splits it, or a CSV (or TSV) per split
of image path and label, read as `dataset=csv` reads it (data/csv_rows.py): `imgtrain-shards train.csv DST --val
val.csv`. Either way the same images land in the same split, with the same labels and classes, as training on
the source would give."""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path

from imgtrain.common.errors import ConfigError
from imgtrain.data.csv_rows import csv_splits
from imgtrain.data.folders import folder_splits
from imgtrain.data.shards.manifest import SPLITS


@dataclass
class Source:
    """The images to pack, per split, with the root their stored paths are relative to."""

    root: Path  # the image folder, or the training CSV's directory
    classes: list[str]
    splits: dict[str, list[tuple[str, int]]]  # split -> (path, label), in listing (or row) order
    layout: dict[str, object]

    @classmethod
    def read(cls, root: str, val_fraction: float, split_seed: int, val: str | None = None) -> Source:
        """SRC: an image folder (`val` None), or the training split's CSV with `val` the validation split's."""
        path = Path(os.path.abspath(os.path.expanduser(root)))
        if path.is_file():
            return cls._from_csv(root, val)
        if val is not None:
            raise ConfigError(
                f"--val={val} names the validation CSV of a CSV SRC, and SRC={root} is a folder: its val/ folder, or "
                "--val-fraction, makes its validation split"
            )
        if not path.is_dir():
            raise ConfigError(
                f"SRC={root} is neither a directory nor a file: point it at an image folder (class folders of "
                "images) or at a CSV of image path and label (with --val <the validation split's CSV>)"
            )
        train, val_split, classes = folder_splits(str(path), val_fraction, split_seed)
        folders = (path / "train").is_dir() and (path / "val").is_dir()
        layout: dict[str, object] = {"layout": "train/ and val/ folders"}
        if not folders:
            layout = {"layout": "one folder, split", "val_fraction": val_fraction, "split_seed": split_seed}
        return cls(path, classes, _pairs(train, val_split), layout)

    @classmethod
    def _from_csv(cls, train: str, val: str | None) -> Source:
        if val is None:
            raise ConfigError(
                f"SRC={train} is a file: a CSV source needs the validation split's CSV too: imgtrain-shards {train} "
                "DST --val <val.csv>"
            )
        if not os.path.isfile(os.path.expanduser(val)):
            raise ConfigError(
                f"--val={val} is not a file: pass the validation split's CSV (or TSV) of image path and label"
            )
        train_split, val_split, classes = csv_splits(train, val, keys=("SRC", "--val"))
        train_file, val_file = (os.path.abspath(os.path.expanduser(file)) for file in (train, val))
        root = Path(os.path.dirname(train_file))  # what the stored paths are relative to
        layout = {"layout": "CSV files", "train": os.path.basename(train_file), "val": os.path.relpath(val_file, root)}
        return cls(root, classes, _pairs(train_split, val_split), layout)

    def fingerprint(self) -> str:
        """What identifies this source: the split, every file's path under SRC, label and size (-1: missing, a
        file the conversion lists as unreadable)."""
        digest = hashlib.sha256(json.dumps({**self.layout, "classes": self.classes}, sort_keys=True).encode())
        for split in SPLITS:
            for path, label in self.splits[split]:
                digest.update(f"{split}\0{self.relative(path)}\0{label}\0{_size(path)}\n".encode())
        return digest.hexdigest()

    def relative(self, path: str) -> str:
        """`path` as stored with its image: relative to the root (`../` for a CSV's image outside its folder)."""
        return os.path.relpath(path, self.root)


def _pairs(train: tuple[list[str], list[int]], val: tuple[list[str], list[int]]) -> dict[str, list[tuple[str, int]]]:
    """Each split's (paths, labels) as (path, label) pairs."""
    return {split: list(zip(*paths_labels, strict=True)) for split, paths_labels in (("train", train), ("val", val))}


def _size(path: str) -> int:
    try:
        return os.path.getsize(path)
    except OSError:
        return -1
