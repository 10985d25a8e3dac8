"""Reading a user's image files, bounded (data/reads.py): a FIFO, a device, a socket or a directory under an image's
name is refused by its type before it is opened, named and counted as unreadable, on every path that reads image
files; a regular file is read up to its size and the cap dataset.max_image_pixels sets, never more."""

from __future__ import annotations

import contextlib
import io
import os
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from imgtrain.data import reads
from imgtrain.data.image_files import CorruptSampleError, EncodedFileDataset, ImageFileDataset
from imgtrain.data.samples import GuardedSamples, collate

KINDS = {
    "pipe.jpg": "a FIFO (named pipe), not a regular file",
    "zero.jpg": "a character device, not a regular file",  # a link to /dev/zero: what it names is read
    "socket.jpg": "a socket, not a regular file",
    "folder.jpg": "a directory, not a regular file",
}


@contextlib.contextmanager
def unblocked(fifo: Path, after_s: float = 20.0) -> Iterator[None]:
    """A writer opens `fifo` after `after_s` and closes it, so that a reader blocked on it ends (with an empty read):
    code that opens FIFOs fails its assertions instead of hanging the suite."""
    done = threading.Event()

    def release() -> None:
        if not done.wait(after_s):
            with contextlib.suppress(OSError), open(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK), "wb"):
                pass

    thread = threading.Thread(target=release, daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()


@pytest.fixture
def folder(tmp_path: Path) -> Iterator[Path]:
    """Two JPEGs, then each kind of path that is not a regular file, under an image's name."""
    for i in range(2):
        out = io.BytesIO()
        Image.fromarray(np.full((24, 32, 3), 60 * i, np.uint8)).save(out, "JPEG")
        (tmp_path / f"{i}.jpg").write_bytes(out.getvalue())
    os.mkfifo(tmp_path / "pipe.jpg")
    (tmp_path / "zero.jpg").symlink_to("/dev/zero")
    (tmp_path / "folder.jpg").mkdir()
    server = socket.socket(socket.AF_UNIX)
    server.bind(str(tmp_path / "socket.jpg"))
    with unblocked(tmp_path / "pipe.jpg"):
        yield tmp_path
    server.close()


def test_what_is_not_a_regular_file_is_refused_by_its_type_and_counted(folder: Path) -> None:
    """Each read at once (not a FIFO's endless open, nor /dev/zero's endless read): the reason names the kind, the
    guard replaces the file in training and counts it; decode=cuda's reads the same."""
    paths = [str(folder / name) for name in ("0.jpg", *KINDS, "1.jpg")]
    dataset = ImageFileDataset(paths, [0] * len(paths), ["a"], lambda image: image)
    started = time.monotonic()
    for index, name in enumerate(KINDS, start=1):
        with pytest.raises(CorruptSampleError) as error:
            dataset.decoded(index)
        assert error.value.path == str(folder / name)
        assert error.value.reason == f"{KINDS[name]}: refused without reading it"
    batch = collate(GuardedSamples(dataset).__getitems__([(1, 7)]))  # replaced by the next readable file
    assert [path for path, _ in batch.skipped] == [str(folder / name) for name in KINDS]
    encoded = EncodedFileDataset(paths, [0] * len(paths), ["a"], None)
    with pytest.raises(CorruptSampleError, match="a FIFO"):
        encoded[1]
    assert time.monotonic() - started < 5  # before: the FIFO's open waited for a writer for ever


def test_a_file_is_read_up_to_its_size_and_the_cap(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The cap follows the pixel limit (16 bytes a pixel and 64 MiB); a larger file is refused unread (a sparse
    one here: nothing is written to disk), and none without a limit."""
    assert reads.byte_cap(None) is None and reads.byte_cap(1000) == 16_000 + (64 << 20)
    big = tmp_path / "big.jpg"
    with open(big, "wb") as f:
        f.truncate(reads.byte_cap(1000) + 1)
    with pytest.raises(reads.UnreadableFile, match=r"67,124,865 bytes, above the 67,124,864 .* not read"):
        reads.read_bytes(str(big), 1000)
    small = tmp_path / "small.jpg"
    small.write_bytes(b"x" * 10)
    assert reads.read_bytes(str(small), 1000) == b"x" * 10
    real = reads._read_exactly
    with open(small, "r+b") as writer:  # the file is cut to 4 bytes after its size (10) was read
        monkeypatch.setattr(reads, "_read_exactly", lambda fd, size: os.ftruncate(writer.fileno(), 4) or real(fd, size))
        assert reads.read_bytes(str(small), 1000) == b"x" * 4


def test_the_thread_reading_a_file_is_known_while_it_reads(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """What names a stuck read (data.engine=threads' timeout): the file this thread is in, and nothing after."""
    (path := tmp_path / "a.jpg").write_bytes(b"abc")
    seen = []
    real = reads._read_exactly

    def reading(fd: int, size: int) -> bytearray:
        seen.append(reads.in_read(threading.get_ident()))
        return real(fd, size)

    monkeypatch.setattr(reads, "_read_exactly", reading)
    assert reads.read_bytes(str(path)) == b"abc"
    assert seen == [str(path)] and reads.in_read(threading.get_ident()) is None
