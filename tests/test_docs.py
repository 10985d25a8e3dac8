"""The README restates some of the code; these checks keep it from drifting (issue 19)."""

from __future__ import annotations

import dataclasses
import re
import typing

from helpers import ROOT

from imgtrain.config.renamed_keys import MOVED_KEYS
from imgtrain.config.schema import AUTO, Config, DataConfig
from imgtrain.metrics.summary import FIELDS

README = (ROOT / "README.md").read_text()


def _rendered(value: object) -> str:
    """A default as the README's tables write it."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return str(value)


def _table_after(heading: str) -> dict[str, str]:
    """The first table after `heading`: its first column (backticks stripped) -> its second."""
    rows: dict[str, str] = {}
    for line in README.split(heading, 1)[1].splitlines()[1:]:
        if not line.startswith("|"):
            if rows:
                break
            continue
        cells = [cell.strip() for cell in line.strip("|").split("|")]
        if cells[0] not in ("key", "field", "---"):
            rows[cells[0].strip("`")] = cells[1].strip("`")
    return rows


def test_the_data_table_lists_every_data_key_with_its_default() -> None:
    table = _table_after("### The DataLoader: `data.*`")
    defaults = {f.name: f.default for f in dataclasses.fields(DataConfig)}
    assert sorted(table) == sorted(defaults)  # every key, once
    for key, default in defaults.items():
        assert table[key] == (AUTO if default == AUTO else _rendered(default)), key


def test_the_training_groups_table_lists_every_key_with_its_default() -> None:
    """train.*, system.*, checkpoint.*, metrics.*, faults.*: the groups trainer.* was split into."""
    table = _table_after("### The recipe, the system, checkpoints, measurement, faults")
    groups = sorted({new.split(".")[0] for new in MOVED_KEYS.values()})
    schemas = typing.get_type_hints(Config)  # the field types, resolved from their annotations
    defaults = {}
    for group in groups:
        defaults |= {f"{group}.{f.name}": f.default for f in dataclasses.fields(schemas[group])}
    assert sorted(table) == sorted(defaults)  # every key, once
    for key, default in defaults.items():
        assert table[key] == _rendered(default), key


def test_the_make_bench_duration_matches_the_makefile() -> None:
    makefile = (ROOT / "Makefile").read_text()
    minutes = re.search(r"^bench: .*?~(\d+) min on 2 CPUs", makefile, re.M).group(1)
    line = next(line for line in README.splitlines() if line.startswith("make bench "))
    assert f"(~{minutes} min on 2 CPUs)" in line, line


def test_source_comments_cite_only_documents_in_the_repository() -> None:
    for path in (ROOT / "src").rglob("*.py"):
        for cited in re.findall(r"\bdocs/[\w./-]*\w", path.read_text()):
            assert (ROOT / cited).exists() or (ROOT / f"{cited}.md").exists(), f"{path}: cites {cited}"


def test_the_metrics_json_table_lists_every_field_in_order() -> None:
    table = _table_after("**`metrics.json`.** Every field")
    assert list(table) == list(FIELDS)
