"""An image folder's layout: its classes and images (as torchvision's ImageFolder lists them), and the train/val
split that `dataset=imagefolder` and `imgtrain-shards` share, so a model trained on shards sees the same split.

Listing opens no file: names and types come from the directories. It is bounded in time all the same: it runs on
a thread of its own, and when no folder has been listed for SCAN_STALL_S seconds (a network file system that no
longer answers), `folder_splits` ends in one line naming the folder being listed (the thread is left behind).
"""

from __future__ import annotations

import os
import threading
import time

import numpy as np
from torchvision.datasets.folder import IMG_EXTENSIONS, find_classes

from imgtrain.common.errors import ConfigError, RunError

LAYOUT_HINT = "expected root/<class>/*.jpg or root/train/<class>/ and root/val/<class>/"
SCAN_STALL_S = 300.0  # seconds without a folder listed: far above one folder's listing on any storage that answers
_listing: dict[int, tuple[str, float]] = {}  # thread id -> the folder it lists now, and since when


def _no_images(root: str) -> ConfigError:
    return ConfigError(f"dataset.root={root} has no class folders with images ({LAYOUT_HINT})")


def list_images(directory: str, class_to_idx: dict[str, int] | None = None) -> tuple[list[str], list[int], list[str]]:
    """(paths, labels, classes) of directory/<class>/**/<image>, as torchvision's ImageFolder lists them.

    Without `class_to_idx` the classes are discovered, and folders without images (or hidden ones) left out.
    """
    if class_to_idx is not None:
        samples = make_dataset(directory, class_to_idx)
        classes = sorted(class_to_idx, key=class_to_idx.__getitem__)
        return [p for p, _ in samples], [label for _, label in samples], classes
    try:
        _note(directory)
        names = [n for n in find_classes(directory)[0] if not n.startswith(".")]
    except FileNotFoundError:
        return [], [], []
    samples = make_dataset(directory, {n: i for i, n in enumerate(names)})
    used = sorted({label for _, label in samples})
    remap = {old: new for new, old in enumerate(used)}
    return [p for p, _ in samples], [remap[label] for _, label in samples], [names[i] for i in used]


def make_dataset(directory: str, class_to_idx: dict[str, int]) -> list[tuple[str, int]]:
    """torchvision's `make_dataset` (same images, same order; classes without images allowed), walking each class
    folder with `_walk`, which refuses a symlink loop instead of following it."""
    samples = []
    for name in sorted(class_to_idx):
        folder = os.path.join(os.path.expanduser(directory), name)
        if not os.path.isdir(folder):
            continue
        for root, files in sorted(_walk(folder)):
            samples += [
                (os.path.join(root, f), class_to_idx[name]) for f in sorted(files) if f.lower().endswith(IMG_EXTENSIONS)
            ]
    return samples


def _walk(top: str) -> list[tuple[str, list[str]]]:
    """(folder, file names) of every folder under `top`, as os.walk(followlinks=True) finds them (symlinked folders
    followed as torchvision follows them; a folder that cannot be listed skipped), but a link back to a folder on
    its own path is one line: os.walk follows it until the path is too long (every image listed tens of times; with
    two such links, for ever). Each folder is noted before it is listed (`_note`)."""
    found, stack = [], [(top, frozenset([os.path.realpath(top)]))]  # a folder, and the real folders on its path
    while stack:
        root, chain = stack.pop()
        _note(root)
        try:
            with os.scandir(root) as entries:
                listed = [(entry.name, _is_dir(entry)) for entry in entries]
        except OSError:
            continue
        for name in [name for name, is_dir in listed if is_dir]:
            path = os.path.join(root, name)
            real = os.path.realpath(path)
            if real in chain:
                raise ConfigError(
                    f"a symlink loop under {top}: {_first_link(top, path)} leads back to {real}, so listing it would "
                    "never end; remove the link or point it elsewhere"
                )
            stack.append((path, chain | {real}))
        found.append((root, [name for name, is_dir in listed if not is_dir]))
    return found


def _is_dir(entry: os.DirEntry) -> bool:
    try:
        return entry.is_dir()  # a link to a folder is one
    except OSError:
        return False


def _note(folder: str) -> None:
    """This thread lists `folder` from now on: what a stalled listing names."""
    _listing[threading.get_ident()] = (folder, time.monotonic())


def _first_link(top: str, path: str) -> str:
    """The symlink on the way from `top` to `path` (what to remove), or `path` itself."""
    current = top
    for part in os.path.relpath(path, top).split(os.sep):
        current = os.path.join(current, part)
        if os.path.islink(current):
            return current
    return path


def split_indices(labels: list[int], val_fraction: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Stratified, deterministic (train, val) index split: each class keeps >= 1 train image."""
    labels_arr = np.asarray(labels, dtype=np.int64)
    rng = np.random.default_rng(seed)
    train, val = [], []
    for label in np.unique(labels_arr):
        members = rng.permutation(np.flatnonzero(labels_arr == label))
        n_val = min(len(members) - 1, round(len(members) * val_fraction))
        val.append(members[:n_val])
        train.append(members[n_val:])
    return np.sort(np.concatenate(train)), np.sort(np.concatenate(val))


def folder_splits(root: str, val_fraction: float, split_seed: int) -> tuple[tuple, tuple, list[str]]:
    """((train paths, labels), (val paths, labels), classes) of an image folder, in either layout (`imgtrain-shards`
    splits the same way, so a model trained on shards sees the same split), listed on a thread of its own: a
    listing that stalls for SCAN_STALL_S is one ConfigError naming the folder."""
    outcome: list = []

    def scan() -> None:
        try:
            outcome.append(_folder_splits(root, val_fraction, split_seed))
        except BaseException as error:  # noqa: BLE001 - raised in the caller's thread
            outcome.append(error)

    thread, started = threading.Thread(target=scan, name="folder-scan", daemon=True), time.monotonic()
    thread.start()
    while not outcome:
        thread.join(timeout=min(1.0, SCAN_STALL_S))
        folder, since = _listing.get(thread.ident, (root, started))
        if not outcome and time.monotonic() - since > SCAN_STALL_S:
            raise RunError(
                f"dataset.root={root}: listing {folder} has not returned in {SCAN_STALL_S:g} s (network storage "
                "that no longer answers?); check the mount, or copy the images to a local disk"
            )
    _listing.pop(thread.ident, None)
    if isinstance(outcome[0], BaseException):
        raise outcome[0]
    return outcome[0]


def _folder_splits(root: str, val_fraction: float, split_seed: int) -> tuple[tuple, tuple, list[str]]:
    train_dir, val_dir = os.path.join(root, "train"), os.path.join(root, "val")
    if os.path.isdir(train_dir) and os.path.isdir(val_dir):
        paths, labels, classes = list_images(train_dir)
        if not classes:
            raise _no_images(root)
        val_paths, val_labels, _ = list_images(val_dir, {c: i for i, c in enumerate(classes)})
        extra = sorted(set(_subdirs(val_dir)) - set(classes))
        if extra or not val_paths:
            what = f"class folders missing from train/: {', '.join(extra[:5])}" if extra else "no images"
            raise ConfigError(f"dataset.root={root}: val/ has {what} ({LAYOUT_HINT})")
        return (paths, labels), (val_paths, val_labels), classes
    paths, labels, classes = list_images(root)
    if not classes:
        raise _no_images(root)
    train_idx, val_idx = split_indices(labels, val_fraction, split_seed)
    if len(val_idx) == 0:
        raise ConfigError(f"dataset.root={root}: too few images for dataset.val_fraction={val_fraction}")
    return _take(paths, labels, train_idx), _take(paths, labels, val_idx), classes


def _take(paths: list[str], labels: list[int], idx: np.ndarray) -> tuple[list[str], list[int]]:
    return [paths[i] for i in idx], [labels[i] for i in idx]


def _subdirs(directory: str) -> list[str]:
    return [e.name for e in os.scandir(directory) if e.is_dir() and not e.name.startswith(".")]
