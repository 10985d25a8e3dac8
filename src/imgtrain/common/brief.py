"""A value read from a user's file, as a one-line message shows it: at most `width` characters, at a cost that does
not grow with the value. Python's repr walks the whole value first: a YAML file or a pickle of a few hundred bytes
can share one list ten times at each of nine levels (a billion items to print), and an integer of more than 4,300
digits has no repr at all (ValueError)."""

from __future__ import annotations

import re
import reprlib
from typing import Any

_LINE_BREAK = re.compile(r"\s*[\r\n]\s*")
_REPR = reprlib.Repr()  # its limits by attribute: keyword arguments came with Python 3.12
# Text, numbers and other objects kept whole up to 200 characters, so that `brief` cuts their end, not their middle
_REPR.maxlevel, _REPR.maxstring, _REPR.maxother, _REPR.maxlong = 3, 200, 200, 200
_REPR.maxlist = _REPR.maxtuple = _REPR.maxdict = _REPR.maxset = _REPR.maxfrozenset = _REPR.maxdeque = 4


def brief(value: Any, width: int = 40) -> str:
    """repr(value), bounded: nested values cut at 3 levels and 4 items, the text cut at `width` characters."""
    try:
        text = _REPR.repr(value)
    except ValueError:  # an integer too long to print (sys.get_int_max_str_digits), nested in anything
        text = f"<{type(value).__name__} too large to print>"
    text = single_line(text)  # a tensor's repr has a line per row
    return text if len(text) <= width else text[: width - 3] + "..."


def single_line(text: str) -> str:
    """`text` with each line break (and the spaces around it) as one space: a table cell or a log line stays one."""
    return _LINE_BREAK.sub(" ", text)


def brief_int(value: int) -> str:
    """A whole number as a message shows it: its digits, or its size when it has too many to print."""
    return str(value) if value.bit_length() <= 64 else f"an integer of {value.bit_length()} bits"
