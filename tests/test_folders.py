"""Listing an image folder (data/folders.py): the images torchvision's ImageFolder lists, symlinked folders
followed, and a listing that stalls (network storage that no longer answers) ended in one line naming the folder."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import pytest
from torchvision.datasets.folder import IMG_EXTENSIONS
from torchvision.datasets.folder import make_dataset as torchvision_make_dataset

from imgtrain.common.errors import RunError
from imgtrain.data import folders


def _tree(root: Path) -> None:
    """Two classes, nested folders, a symlinked folder, a hidden one, and files that are not images."""
    for relative in ("cat/a.jpg", "cat/deep/er/b.png", "cat/notes.txt", "dog/c.JPEG", "dog/.hidden/d.jpg"):
        (root / relative).parent.mkdir(parents=True, exist_ok=True)
        (root / relative).write_bytes(b"x")
    (root / "elsewhere").mkdir()
    (root / "elsewhere" / "e.jpg").write_bytes(b"x")
    (root / "dog" / "linked").symlink_to(root / "elsewhere")


def test_the_listing_is_torchvisions(tmp_path: Path) -> None:
    _tree(tmp_path / "images")
    classes = {"cat": 0, "dog": 1}
    ours = folders.make_dataset(str(tmp_path / "images"), classes)
    assert ours == torchvision_make_dataset(str(tmp_path / "images"), classes, extensions=IMG_EXTENSIONS)
    assert (str(tmp_path / "images" / "dog" / "linked" / "e.jpg"), 1) in ours


def test_a_listing_that_stalls_is_one_line_naming_the_folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Here the listing of one class folder is held (as a hung NFS mount holds it); after SCAN_STALL_S without a
    folder listed the run ends naming it, the listing thread left behind. Before, it waited for ever."""
    _tree(tmp_path / "images")
    stuck, real = threading.Event(), os.scandir
    held = str(tmp_path / "images" / "dog")

    def scandir(path: str = ".") -> object:
        if str(path) == held:
            stuck.wait(20)
        return real(path)

    monkeypatch.setattr(folders, "SCAN_STALL_S", 1.0)
    monkeypatch.setattr(os, "scandir", scandir)
    started = time.monotonic()
    try:
        with pytest.raises(RunError, match=f"listing {held} has not returned in 1 s"):
            folders.folder_splits(str(tmp_path / "images"), 0.5, 0)
        assert time.monotonic() - started < 10
    finally:
        stuck.set()
