"""Fuzz targets for the CSV of image paths and labels (data/csv_rows.py: dataset=csv, imgtrain-shards' CSV source),
seeded from fuzz_seeds/csv/ (a header, TSV, quotes, Excel's BOM and CRLF, a quote left open, a NUL byte, Latin-1,
three columns, ~ and absolute paths). The properties:
- any bytes in the file: only ConfigError (one line naming the file or file:line) escapes, within the bound;
- rows the csv module writes (paths with commas, quotes, spaces, any script; labels of any text) read back as
  written: each path joined to the file's folder, each label kept, a header row skipped; csv_splits numbers the
  classes so that each row's class index names its own label.
"""

from __future__ import annotations

import csv
import io
import os
from pathlib import Path

import pytest
from fuzzing import bounded, fast, mutated, seed_files, slow
from hypothesis import given
from hypothesis import strategies as st

from imgtrain.common.errors import ConfigError
from imgtrain.data.csv_rows import IMAGE_SUFFIXES, csv_splits, read_rows

SEEDS = seed_files("csv")


def _read(folder: Path, name: str, data: bytes) -> list[tuple[str, str]] | None:
    path = folder / name
    path.write_bytes(data)
    try:
        with bounded(f"reading {name}"):
            rows = read_rows(str(path), "dataset.train")
    except ConfigError as error:
        assert "\n" not in str(error) and str(path) in str(error), error
        return None
    assert rows and all(os.path.isabs(p) and label and "\n" not in label for p, label in rows)
    return rows


def damaged_target(folder: Path, data: bytes, suffix: str) -> None:
    _read(folder, f"rows{suffix}", data)


# A cell as a user's CSV holds one: no line break, NUL, tab (the delimiter of TSV, found by the first line's tab)
# or BOM, and nothing csv_rows strips from either end; a path does not start with `~` (the home folder).
_CHARS = st.characters(exclude_characters="\r\n\x00\t\ufeff", exclude_categories=("Cs",))
_CELL = st.text(_CHARS, min_size=1, max_size=12).filter(lambda cell: cell == cell.strip())
_PATH = st.tuples(_CELL.filter(lambda cell: not cell.startswith("~")), st.sampled_from(IMAGE_SUFFIXES)).map("".join)
ROWS = st.lists(st.tuples(_PATH, _CELL), min_size=1, max_size=6)


def _written(rows: list[tuple[str, str]], tab: bool, header: bool) -> bytes:
    text = io.StringIO(newline="")
    writer = csv.writer(text, delimiter="\t" if tab else ",")
    writer.writerows([("path", "label")] * header + rows)
    return text.getvalue().encode()


def round_trip_target(folder: Path, rows: list[tuple[str, str]], tab: bool, header: bool) -> None:
    name = "rows.tsv" if tab else "rows.csv"
    read = _read(folder, name, _written(rows, tab, header))
    assert read == [(os.path.normpath(os.path.join(folder, path)), label) for path, label in rows]
    (folder / "val.csv").write_bytes(_written(rows[:1], False, False))
    with bounded("csv_splits"):
        (paths, labels), (_, val_labels), classes = csv_splits(str(folder / name), str(folder / "val.csv"))
    assert [classes[i] for i in labels] == [label for _, label in rows] and classes[val_labels[0]] == rows[0][1]


@fast()
@given(mutated(list(SEEDS.values())), st.sampled_from([".csv", ".tsv"]))
def test_any_bytes_in_a_csv_end_in_one_line_or_rows(tmp_path: Path, data: bytes, suffix: str) -> None:
    damaged_target(tmp_path, data, suffix)


@fast()
@given(ROWS, st.booleans(), st.booleans())
def test_rows_the_csv_module_writes_read_back_as_written(
    tmp_path: Path, rows: list[tuple[str, str]], tab: bool, header: bool
) -> None:
    round_trip_target(tmp_path, rows, tab, header)


def test_every_seed_reads_or_is_one_line(tmp_path: Path) -> None:
    outcome = {name: _read(tmp_path, name, data) is not None for name, data in SEEDS.items()}
    assert {name for name, read in outcome.items() if not read} == {
        "quote_left_open.csv",
        "nul_byte.csv",
        "latin1.csv",
        "three_columns.csv",
    }


def test_a_fifo_or_a_device_named_as_the_csv_is_refused_without_reading(tmp_path: Path) -> None:
    """open() on a FIFO waits for a writer: dataset.train naming one hung the run before any work."""
    fifo = tmp_path / "train.csv"
    os.mkfifo(fifo)
    for path in (fifo, Path("/dev/zero")):
        with bounded(f"reading {path}"), pytest.raises(ConfigError, match="not a regular file: refused without"):
            read_rows(str(path), "dataset.train")


@pytest.mark.slow  # about a minute: each target on SLOW examples
def test_the_csv_targets_on_a_larger_budget(tmp_path: Path) -> None:
    slow()(
        given(mutated(list(SEEDS.values())), st.sampled_from([".csv", ".tsv"]))(
            lambda data, suffix: damaged_target(tmp_path, data, suffix)
        )
    )()
    slow()(
        given(ROWS, st.booleans(), st.booleans())(
            lambda rows, tab, header: round_trip_target(tmp_path, rows, tab, header)
        )
    )()
