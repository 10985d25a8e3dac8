"""What the fuzz targets of the template's parsers share (tests/test_fuzz_*.py): the budgets, the bound on one input,
and Hypothesis strategies that mutate the seeds kept in tests/fuzz_seeds/<target>/ (real files and crafted ones;
every crash or hang a target found is one of them).

Each target is a function of one input that asserts its properties; the fast suite runs it on FAST examples and
`make test-slow` on SLOW (the slow test of each module). Hypothesis' deadline reports an input slower than
DEADLINE_MS, `bounded` stops one that hangs (a deadline only measures a call that returns)."""

from __future__ import annotations

import contextlib
import json
import math
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from bounded import within

# The GPU box has no Hypothesis: the fuzz modules, which import this one, are skipped there, not errors
pytest.importorskip("hypothesis", reason="the fuzz targets need Hypothesis: pip install -e '.[dev]'")

from hypothesis import HealthCheck, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

SEEDS = Path(__file__).resolve().parent / "fuzz_seeds"
FAST, SLOW = 40, 500  # examples per target: the fast suite's second or so, make test-slow's minute
DEADLINE_MS = 1000  # the bound on one input (ms)
# tmp_path serves every example of a test (each writes its own subfolder); a seed may be slow to shrink
QUIET = [HealthCheck.function_scoped_fixture, HealthCheck.too_slow, HealthCheck.data_too_large]


def fast(**more: Any) -> Callable:
    return settings(max_examples=FAST, deadline=DEADLINE_MS, suppress_health_check=QUIET, **more)


def slow(**more: Any) -> Callable:
    return settings(max_examples=SLOW, deadline=DEADLINE_MS, suppress_health_check=QUIET, **more)


@contextlib.contextmanager
def bounded(what: str = "one input", seconds: float = DEADLINE_MS / 1000 * 2) -> Iterator[None]:
    """The block must end within `seconds` (by default twice the deadline: a loaded machine's margin, and still a
    hang's bound): a hang fails the example instead of the suite."""
    with within(seconds, what):
        yield


def seed_files(target: str, pattern: str = "*") -> dict[str, bytes]:
    return {path.name: path.read_bytes() for path in sorted((SEEDS / target).glob(pattern)) if path.is_file()}


# ----------------------------------------------------------------------------- byte mutations
_SPECIAL = [b"\x00", b"\xff", b"\n", b"\r", b'"', b",", b"\t", b"\\", b"[", b"{", b"&a ", b"*a", b"\xef\xbb\xbf"]


@st.composite
def mutated(draw: st.DrawFn, seeds: list[bytes]) -> bytes:
    """A seed with up to 8 byte-level edits: a flip, an insert (random or a delimiter), a deletion, a cut, a run
    repeated, a splice from another seed."""
    data = bytearray(draw(st.sampled_from(seeds)))
    for _ in range(draw(st.integers(0, 8))):
        at = draw(st.integers(0, len(data)))
        edit = draw(st.sampled_from(("flip", "insert", "special", "delete", "cut", "repeat", "splice")))
        if edit == "flip" and at < len(data):
            data[at] ^= 1 << draw(st.integers(0, 7))
        elif edit == "insert":
            data[at:at] = draw(st.binary(min_size=1, max_size=8))
        elif edit == "special":
            data[at:at] = draw(st.sampled_from(_SPECIAL))
        elif edit == "delete":
            del data[at : at + draw(st.integers(1, 16))]
        elif edit == "cut":
            del data[at:]
        elif edit == "repeat":
            run = data[at : at + draw(st.integers(1, 32))]
            data[at:at] = run * draw(st.integers(1, 64))
        elif edit == "splice":
            other = draw(st.sampled_from(seeds))
            start = draw(st.integers(0, len(other)))
            data[at:] = other[start:]
    return bytes(data)


# ----------------------------------------------------------------------------- JSON trees
NUMBERS = st.one_of(
    st.integers(),
    st.sampled_from([0, -1, 1, 2**31, 2**63, 10**12, 10**30, -(10**30), 10**400]),
    st.floats(allow_nan=True, allow_infinity=True),
)
JSON_LEAVES = st.one_of(st.none(), st.booleans(), NUMBERS, st.text(max_size=20))
JSON_VALUES = st.recursive(
    JSON_LEAVES,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=10), inner, max_size=4),
    max_leaves=12,
)


@st.composite
def mutated_tree(draw: st.DrawFn, seed: Any, leaves: st.SearchStrategy = JSON_VALUES) -> Any:
    """A copy of the parsed `seed` with up to 4 edits, each at a path drawn through it: a value replaced by one of
    `leaves`, a key or item deleted, or a key added."""
    tree = json.loads(json.dumps(seed))
    for _ in range(draw(st.integers(1, 4))):
        tree = _edit(draw, tree, leaves, root=True)
    return tree


# What a number in a file is most often replaced by to break its reader: a value of another type that converts
# (a numeric string, a bool), one no int holds (infinity, NaN, 1e400 read as infinity), one no C integer holds
INTERESTING = [float("inf"), float("-inf"), float("nan"), 1e400, -1, 0, 2**63, 10**400, "5", True, None, 0.5, []]


def _edit(draw: st.DrawFn, node: Any, leaves: st.SearchStrategy, root: bool = False) -> Any:
    """`node` with one edit at or below it (below it, for the file's whole value: a file of another shape is one
    edit among thousands, not one in four)."""
    if isinstance(node, (int, float)) and not isinstance(node, bool) and draw(st.booleans()):
        return draw(st.sampled_from(INTERESTING))
    if not isinstance(node, (dict, list)) or not node:
        return draw(leaves)
    if draw(st.integers(0, 3)) == 0:
        if not root and draw(st.booleans()):
            return draw(leaves)
        return _shrunk(draw, node)
    key = draw(st.sampled_from(list(node) if isinstance(node, dict) else range(len(node))))
    node[key] = _edit(draw, node[key], leaves)
    if isinstance(node, dict) and draw(st.integers(0, 5)) == 0:
        node[draw(st.text(max_size=10))] = draw(leaves)
    return node


def _shrunk(draw: st.DrawFn, node: dict | list) -> dict | list:
    """`node` without one of its keys or items."""
    if isinstance(node, dict):
        node.pop(draw(st.sampled_from(list(node))), None)
    else:
        del node[draw(st.integers(0, len(node) - 1))]
    return node


def json_text(tree: Any) -> str:
    """`tree` as JSON, Python's way: NaN and Infinity written as json.dumps writes them (json.loads reads them)."""
    return json.dumps(tree, allow_nan=True)


def finite(value: Any) -> bool:
    return not isinstance(value, float) or math.isfinite(value)
