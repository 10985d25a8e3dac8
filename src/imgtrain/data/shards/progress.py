"""`imgtrain-shards`' progress while it packs a split: a bar fed by the workers' shared counter, and its time bound,
`--stall-timeout` (STALL_S by default): when no image has been packed for that long (a read hung in network
storage, a decode that never ends), the conversion stops in one line naming the files the workers are on.

Each worker keeps the file it is on in a small file of its own (`Busy`: `<pid>.busy` in the split's report
folder, rewritten in place, two system calls an image); the bar's thread reads them when it finds the stall, and
interrupts the main thread as Ctrl-C would, so that the conversion unwinds as from a stop (its workers ended, the
staging folder removed).
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from tqdm import tqdm

STALL_S = 600  # seconds without an image packed: far above one image's decode (a 100-MP PNG takes seconds)
_SUFFIX = ".busy"


class Busy:
    """In a worker: the file it is on (`on`), or none (`off`), in `<folder>/<pid>.busy`, opened on first use."""

    def __init__(self, folder: str) -> None:
        self.folder, self.pid, self.fd = folder, None, -1

    def on(self, relative: str) -> None:
        if self.pid != os.getpid():  # the first image of this (forked) process
            self.pid = os.getpid()
            self.fd = os.open(os.path.join(self.folder, f"{self.pid}{_SUFFIX}"), os.O_WRONLY | os.O_CREAT, 0o600)
        text = relative.encode()
        os.pwrite(self.fd, text, 0)
        os.ftruncate(self.fd, len(text))

    def off(self) -> None:
        if self.pid == os.getpid():
            os.ftruncate(self.fd, 0)


def in_hand(folder: str) -> list[str]:
    """The files the workers are on now, as their Busy files say."""
    found = []
    for name in sorted(os.listdir(folder)):
        if name.endswith(_SUFFIX):
            with contextlib.suppress(OSError):
                text = Path(folder, name).read_text().strip()
                found += [text] if text else []
    return found


@dataclass
class Watch:
    """What the bar's thread found: why it stopped the conversion, or None."""

    stalled: str | None = None


@contextlib.contextmanager
def progress(done, total: int, split: str, stall_s: float, folder: str) -> Iterator[Watch]:
    """A bar with images/s, fed by the workers' shared counter `done` (LitData's own bar moves only when a worker
    ends); past `stall_s` seconds (0: never) without an image, the Watch says why and the main thread is
    interrupted."""
    bar = tqdm(total=total, desc=f"packing {split}", unit="img", dynamic_ncols=True, file=sys.stdout)
    stop, watch = threading.Event(), Watch()

    def follow() -> None:
        last, since = done.value, time.monotonic()
        while not stop.wait(0.5):
            bar.update(done.value - bar.n)
            if done.value != last:
                last, since = done.value, time.monotonic()
            elif stall_s and time.monotonic() - since > stall_s:
                files = ", ".join(in_hand(folder)[:4]) or "no file (the workers are between files)"
                watch.stalled = (
                    f"no image packed in {stall_s:g} s (--stall-timeout): the workers are on {files} (hung storage, "
                    "or a file that takes longer: raise --stall-timeout, or 0 for no limit)"
                )
                signal.pthread_kill(threading.main_thread().ident, signal.SIGINT)
                return

    thread = threading.Thread(target=follow, daemon=True)
    thread.start()
    try:
        yield watch
    finally:
        stop.set()
        thread.join()
        bar.update(done.value - bar.n)
        bar.close()
