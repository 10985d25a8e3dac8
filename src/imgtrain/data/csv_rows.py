"""A CSV (or TSV) of image paths and labels: what `dataset=csv` and `imgtrain-shards` read.

The format:
- one row per image: its path, then its label; comma-separated, or tab-separated when the file ends in `.tsv` or
  its first line holds a tab. Quoting is the csv module's (a path holding a comma is written in double quotes).
- paths are relative to the file's own directory (absolute ones are kept as they are; `~` is expanded).
- labels are class names, numbers included; the classes are the union of the train and val labels, sorted (by
  value when every label is an integer, so labels 0..N-1 keep their index; by name otherwise).
- an optional header: a first row whose first cell is neither an existing file nor a name with an image
  extension (`path,label`, `filename,class`, ...) is skipped.
- blank lines are skipped; a row without exactly two columns, or with an empty one, is one line naming file:line.
"""

from __future__ import annotations

import csv
import io
import logging
import os

from torchvision.datasets.folder import IMG_EXTENSIONS

from imgtrain.resilience.errors import ConfigError, first_line

log = logging.getLogger(__name__)

IMAGE_SUFFIXES = (*IMG_EXTENSIONS, ".gif")  # what a path in a CSV usually ends with (the header test)
CSV_FORMAT = "one row per image: its path (relative to the file) and its label, comma- or tab-separated"
Split = tuple[list[str], list[int]]  # (paths, labels) of one split


def read_rows(file: str, key: str) -> list[tuple[str, str]]:
    """(absolute image path, label) of each row of `file` (the format: the module docstring); a problem is one
    ConfigError naming `key` (e.g. dataset.train) or file:line."""
    path = os.path.abspath(os.path.expanduser(file))
    try:
        with open(path, newline="", encoding="utf-8-sig") as f:  # -sig: a BOM (Excel's UTF-8 CSV) is not a path
            text = f.read()
    except (OSError, UnicodeDecodeError) as error:
        raise ConfigError(
            f"{key}={file} cannot be read ({first_line(error)}): expected a UTF-8 text file, {CSV_FORMAT}"
        ) from None
    tab = path.lower().endswith(".tsv") or "\t" in text.split("\n", 1)[0]
    reader = csv.reader(io.StringIO(text), delimiter="\t" if tab else ",")
    base, rows, first = os.path.dirname(path), [], True
    try:
        for row in reader:
            cells = [cell.strip() for cell in row]
            if not any(cells):
                continue
            header, first = first and _is_header(cells[0], base), False
            if header:
                continue
            if len(cells) != 2 or not all(cells):
                found = f"{len(cells)} column(s)" if len(cells) != 2 else "an empty cell"
                raise ConfigError(f"{file}:{reader.line_num}: expected 2 columns, image path and label; found {found}")
            rows.append((os.path.normpath(os.path.join(base, os.path.expanduser(cells[0]))), cells[1]))
    except csv.Error as error:  # a NUL byte, a quote left open at the end
        raise ConfigError(f"{file}:{reader.line_num}: not a readable CSV row ({error}): {CSV_FORMAT}") from None
    if not rows:
        raise ConfigError(f"{key}={file} has no rows: expected {CSV_FORMAT} (a header row is optional)")
    return rows


def _is_header(cell: str, base: str) -> bool:
    """A first row is a header when its first cell neither names an image (by its extension) nor an existing file."""
    named = os.path.join(base, os.path.expanduser(cell))
    return not cell.lower().endswith(IMAGE_SUFFIXES) and not os.path.isfile(named)


def class_order(labels: set[str]) -> list[str]:
    """The labels sorted: by value when every one is an integer (labels 0..N-1 keep their index), else by name."""
    try:
        return sorted(labels, key=lambda label: (int(label), label))
    except ValueError:
        return sorted(labels)


def csv_splits(train: str, val: str, keys: tuple[str, str] = ("dataset.train", "dataset.val")) -> tuple:
    """((train paths, labels), (val paths, labels), classes) of a CSV per split; `keys` name them in errors. A
    validation label with no training row is said in one line: the model can never predict it."""
    train_rows, val_rows = read_rows(train, keys[0]), read_rows(val, keys[1])
    trained = {label for _, label in train_rows}
    unseen = class_order({label for _, label in val_rows} - trained)
    if unseen:
        more = f" and {len(unseen) - 5} more" if len(unseen) > 5 else ""
        listed = ", ".join(repr(label) for label in unseen[:5]) + more
        log.warning(
            "%s=%s: label(s) %s have no row in %s=%s: they are classes the model is never trained on",
            *(keys[1], val, listed, keys[0], train),
        )
    classes = class_order(trained | {label for _, label in val_rows})
    index = {name: i for i, name in enumerate(classes)}

    def split(rows: list[tuple[str, str]]) -> Split:
        return [path for path, _ in rows], [index[label] for _, label in rows]

    return split(train_rows), split(val_rows), classes
