"""A time bound for a call that must not hang: SIGALRM raises `TookTooLong` in the main thread when the bound
passes, so a test fails in seconds where the code under test would have run for days (a Python loop, a blocking
read: both are interrupted by the signal)."""

from __future__ import annotations

import contextlib
import signal
from collections.abc import Iterator


class TookTooLong(Exception):
    """The call ran past its bound."""


@contextlib.contextmanager
def within(seconds: float, what: str = "the call") -> Iterator[None]:
    """Raise TookTooLong if the block runs longer than `seconds` (main thread only; not nestable)."""

    def too_long(signum, frame) -> None:
        raise TookTooLong(f"{what} took more than {seconds:g} s")

    previous = signal.signal(signal.SIGALRM, too_long)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
