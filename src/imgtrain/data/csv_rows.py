"""A CSV (or TSV) of image paths and labels: what `dataset=csv` and `imgtrain-shards` read.

The format:
- one row per image: its path, then its label; comma-separated, or tab-separated when the file ends in `.tsv` or
  its first line holds a tab. Quoting is the csv module's (a path holding a comma is written in double quotes).
- paths are relative to the file's own directory (absolute ones are kept as they are; `~` is expanded).
- labels are class names, numbers included, compared as text: `01` and `1` are two classes (said once in the log);
  the classes are the union of the train and val labels, sorted (by value when every label is an integer, so
  labels 0..N-1 keep their index; by name otherwise).
- an optional header: a first row whose first cell is neither an existing file nor a name with an image
  extension (`path,label`, `filename,class`, ...) is skipped, and the log says which row and why.
- blank lines are skipped; a row without exactly two columns, or with an empty one, is one line naming file:line,
  and so is a quote left open (at the end, or in the middle, where it would swallow the rows up to the next quote).
"""

from __future__ import annotations

import csv
import io
import logging
import os

from torchvision.datasets.folder import IMG_EXTENSIONS

from imgtrain.common.errors import ConfigError, first_line
from imgtrain.data.reads import read_bytes

log = logging.getLogger(__name__)

IMAGE_SUFFIXES = (*IMG_EXTENSIONS, ".gif")  # what a path in a CSV usually ends with (the header test)
CSV_FORMAT = "one row per image: its path (relative to the file) and its label, comma- or tab-separated"
Split = tuple[list[str], list[int]]  # (paths, labels) of one split


def read_rows(file: str, key: str) -> list[tuple[str, str]]:
    """(absolute image path, label) of each row of `file` (the format: the module docstring); a problem is one
    ConfigError naming `key` (e.g. dataset.train) or file:line."""
    path = os.path.abspath(os.path.expanduser(file))
    try:  # a regular file only, at most its size (a FIFO would block the open, /dev/zero never end)
        text = bytes(read_bytes(path, max_pixels=None)).decode("utf-8-sig")  # -sig: Excel's BOM is not a path
    except (OSError, UnicodeDecodeError) as error:
        raise ConfigError(
            f"{key}={file} cannot be read ({first_line(error)}): expected a UTF-8 text file, {CSV_FORMAT}"
        ) from None
    tab = path.lower().endswith(".tsv") or "\t" in text.split("\n", 1)[0]
    delimiter = "\t" if tab else ","
    reader = csv.reader(io.StringIO(text), delimiter=delimiter)
    base, rows, first, read = os.path.dirname(path), [], True, 0
    try:
        for row in reader:
            line, read = read + 1, reader.line_num  # the row's first line, and its last
            cells = [cell.strip() for cell in row]
            if not any(cells):
                continue
            _check_quotes(cells, file, line, read)
            header, first = first and _is_header(cells[0], base), False
            if header:
                log.info(
                    "%s:%d: row %r taken as a header, not an image: %r has no image extension and no file %s exists; "
                    "if it is an image's row, write its file's name with the extension",
                    *(file, line, delimiter.join(cells), cells[0], os.path.join(base, os.path.expanduser(cells[0]))),
                )
                continue
            if len(cells) != 2 or not all(cells):
                found = f"{len(cells)} column(s)" if len(cells) != 2 else "an empty cell"
                raise ConfigError(f"{file}:{reader.line_num}: expected 2 columns, image path and label; found {found}")
            rows.append((os.path.normpath(os.path.join(base, os.path.expanduser(cells[0]))), cells[1]))
    except csv.Error as error:  # a quote left open at the end, a field longer than the csv module's limit
        raise ConfigError(f"{file}:{reader.line_num}: not a readable CSV row ({error}): {CSV_FORMAT}") from None
    if not rows:
        raise ConfigError(f"{key}={file} has no rows: expected {CSV_FORMAT} (a header row is optional)")
    return rows


def _check_quotes(cells: list[str], file: str, line: int, last: int) -> None:
    """A cell spanning lines is a quote left open: the csv module reads on to the next quote, whatever rows lie
    between (no path or label holds a line break). A NUL byte is no text (the csv module reads it since Python
    3.11, and a path holding one names another file where C code cuts it there)."""
    for i, cell in enumerate(cells):
        if "\x00" in cell:
            raise ConfigError(f"{file}:{line}: a NUL byte in the row ({cell!r}): {CSV_FORMAT}")
        if "\n" in cell or "\r" in cell:
            what = ("path", "label")[i] if i < 2 else f"column {i + 1}"
            raise ConfigError(
                f"{file}:{line}: a quote opened in this row closes only on line {last}, so lines {line}-{last} read "
                f"as one row ({what} {cell!r}): close the quote on line {line}, or remove it"
            )


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
    same = _same_numbers(classes)
    if same:
        listed = "; ".join(_listing(group) for group in same[1:4]) + ("; ..." if len(same) > 4 else "")
        log.warning(
            "%s=%s, %s=%s: labels are text: %s are the same number but %d classes%s (%d classes in all); write each "
            "class one way if they are one class",
            *(keys[0], train, keys[1], val, _listing(same[0]), len(same[0])),
            *(f", as are {listed}" if listed else "", len(classes)),
        )
    index = {name: i for i, name in enumerate(classes)}

    def split(rows: list[tuple[str, str]]) -> Split:
        return [path for path, _ in rows], [index[label] for _, label in rows]

    return split(train_rows), split(val_rows), classes


def _same_numbers(labels: list[str]) -> list[list[str]]:
    """The groups of labels that are one integer written differently (`1`, `01`), in `labels`' order."""
    by_value: dict[int, list[str]] = {}
    for label in labels:
        try:
            by_value.setdefault(int(label), []).append(label)
        except ValueError:
            continue
    return [group for group in by_value.values() if len(group) > 1]


def _listing(labels: list[str]) -> str:
    return ", ".join(repr(label) for label in labels[:-1]) + f" and {labels[-1]!r}"
