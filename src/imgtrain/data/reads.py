"""Reading a user's image file, bounded: a regular file only, refused by its type before it is opened (a FIFO would
block the open until a writer comes, a device such as /dev/zero never ends), and never more bytes than its size
and a cap that follows dataset.max_image_pixels (`byte_cap`). Every path that reads image files reads through here:
the Datasets' items, the decode-bound verdict's sample and `imgtrain-shards`.

A read that hangs in the kernel (hung network storage) cannot be stopped from Python: `data.timeout` bounds the
training loaders' waits, and `in_read` names the file each thread is reading, so that the line naming a stuck
read names the file actually stuck.
"""

from __future__ import annotations

import os
import stat
import threading

from imgtrain.config.datasets import MAX_IMAGE_PIXELS

# The most bytes a pixel takes in a file PIL reads: 4 channels of 32-bit floats (an uncompressed TIFF). A file
# larger than its pixel limit allows, plus METADATA_BYTES, cannot be an image within that limit.
BYTES_PER_PIXEL = 16
# What a file may hold besides its pixels: EXIF (with its thumbnail), ICC profiles, XMP, a phone's embedded preview
METADATA_BYTES = 64 << 20
_KINDS = {  # what a path that is not a regular file is, by stat's type bits
    stat.S_IFIFO: "a FIFO (named pipe)",
    stat.S_IFCHR: "a character device",
    stat.S_IFBLK: "a block device",
    stat.S_IFSOCK: "a socket",
    stat.S_IFDIR: "a directory",
}
_reading: dict[int, str] = {}  # thread id -> the file it is reading now


class UnreadableFile(OSError):
    """A path that is not read: not a regular file, or larger than the cap. An OSError, as a missing file is: every
    caller already counts those as unreadable."""


def byte_cap(max_pixels: int | None = MAX_IMAGE_PIXELS) -> int | None:
    """The most bytes an image file within `max_pixels` (dataset.max_image_pixels) may take; None without a limit."""
    return None if max_pixels is None else BYTES_PER_PIXEL * max_pixels + METADATA_BYTES


def in_read(thread_id: int) -> str | None:
    """The file thread `thread_id` of this process is reading now (None: none): what a stuck thread is stuck in."""
    return _reading.get(thread_id)


def read_bytes(path: str, max_pixels: int | None = MAX_IMAGE_PIXELS) -> bytearray:
    """The bytes of the regular file `path` (a link is followed to one): at most its size, and at most `byte_cap`
    (`max_pixels`: dataset.max_image_pixels); UnreadableFile for anything else, before it is opened. OSError as
    `open` raises it (a missing file, no permission)."""
    cap = byte_cap(max_pixels)
    found = os.stat(path)
    _check(found.st_mode, found.st_size, cap)  # by its type, before anything opens it
    thread = threading.get_ident()
    _reading[thread] = path
    try:
        # O_NONBLOCK: a path swapped for a FIFO since the stat is not waited on at its open (no effect on files)
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | os.O_NOCTTY)
        try:
            info = os.fstat(fd)
            _check(info.st_mode, info.st_size, cap)  # what was opened, in case the path changed since
            return _read_exactly(fd, info.st_size)
        finally:
            os.close(fd)
    finally:
        _reading.pop(thread, None)


def _check(mode: int, size: int, cap: int | None) -> None:
    if not stat.S_ISREG(mode):
        kind = _KINDS.get(stat.S_IFMT(mode), "not a regular file")
        raise UnreadableFile(f"{kind}, not a regular file: refused without reading it")
    if cap is not None and size > cap:
        raise UnreadableFile(
            f"{size:,} bytes, above the {cap:,} an image within dataset.max_image_pixels may take "
            f"({BYTES_PER_PIXEL} bytes a pixel and {METADATA_BYTES >> 20} MiB of metadata); not read"
        )


def _read_exactly(fd: int, size: int) -> bytearray:
    """Up to `size` bytes from `fd`: fewer if the file shrank meanwhile, never more if it grew."""
    buffer, filled = bytearray(size), 0
    with memoryview(buffer) as view:
        while filled < size:
            count = os.readv(fd, [view[filled:]])
            if count == 0:  # the end came early: the file shrank after the stat
                break
            filled += count
    del buffer[filled:]
    return buffer
