"""The README and docs/ restate some of the code; these checks keep them from drifting (issues 19 and 31)."""

from __future__ import annotations

import dataclasses
import re
import typing
from pathlib import Path

from helpers import ROOT

from imgtrain.config import reference, val_metrics
from imgtrain.config.data import DataConfig
from imgtrain.config.loss import CrossEntropyConfig, FocalLossConfig
from imgtrain.config.model import TimmModelConfig, TorchvisionModelConfig
from imgtrain.config.renamed_keys import MOVED_KEYS
from imgtrain.config.schedule import StepDecayConfig, WarmupCosineConfig
from imgtrain.config.schema import Config
from imgtrain.metrics.summary import FIELDS

README = (ROOT / "README.md").read_text()
DOCS = ROOT / "docs"
README_MAX_LINES = 300
# Links not yet required to exist: the fork examples the lead engineer is writing. Remove once they are in.
LINKS_NOT_CHECKED: tuple[str, ...] = ()


def _page(name: str) -> str:
    return (DOCS / name).read_text()


def _table_after(text: str, heading: str) -> dict[str, str]:
    """The first table after `heading`: its first column (backticks stripped) -> its second."""
    rows: dict[str, str] = {}
    for line in text.split(heading, 1)[1].splitlines()[1:]:
        if not line.startswith("|"):
            if rows:
                break
            continue
        cells = [cell.strip() for cell in line.strip("|").split("|")]
        if cells[0] not in ("key", "field", "---"):
            rows[cells[0].strip("`")] = cells[1].strip("`")
    return rows


def test_the_configuration_reference_is_generated_from_the_schemas(tmp_path: Path) -> None:
    fresh = tmp_path / "configuration-reference.md"
    reference.main([str(fresh)])
    committed = DOCS / "configuration-reference.md"
    assert committed.exists() and committed.read_text() == fresh.read_text(), (
        "docs/configuration-reference.md is stale: run `make docs` and commit it"
    )


# The groups whose node is a choice of schemas (typed Any in Config): each of their schemas
CHOSEN = {
    "model": (TorchvisionModelConfig, TimmModelConfig),
    "loss": (CrossEntropyConfig, FocalLossConfig),
    "schedule": (WarmupCosineConfig, StepDecayConfig),
}


def _group_keys(group: str) -> set[str]:
    """Every key `group.<key>` that a schema of `group` has."""
    schemas = CHOSEN.get(group) or (typing.get_type_hints(Config)[group],)
    return {f"{group}.{spec.name}" for cls in schemas for spec in dataclasses.fields(cls) if spec.name != "_target_"}


def test_the_reference_lists_every_key_of_every_group() -> None:
    text = _page("configuration-reference.md")
    for group in ("data", "train", "system", "checkpoint", "metrics", "faults", *CHOSEN):
        for key in _group_keys(group):
            assert f"| `{key}` |" in text, key


def test_the_configuration_page_explains_only_keys_that_exist() -> None:
    """docs/configuration.md's hand-written tables need not list every key (the reference does), but may not
    name a key that is gone."""
    text = _page("configuration.md")
    data_keys = {f.name for f in dataclasses.fields(DataConfig)}
    assert set(_table_after(text, "### The DataLoader: `data.*`")) <= data_keys
    groups = sorted({new.split(".")[0] for new in MOVED_KEYS.values()} | set(CHOSEN))
    keys = set().union(*(_group_keys(group) for group in groups))
    assert set(_table_after(text, "### The recipe, the system, checkpoints, measurement, faults")) <= keys


def test_the_make_bench_duration_matches_the_makefile() -> None:
    makefile = (ROOT / "Makefile").read_text()
    minutes = re.search(r"^bench: .*?~(\d+) min on 2 CPUs", makefile, re.M).group(1)
    line = next(line for line in _page("development.md").splitlines() if line.startswith("make bench "))
    assert f"(~{minutes} min on 2 CPUs)" in line, line


def test_source_comments_cite_only_documents_in_the_repository() -> None:
    for path in (ROOT / "src").rglob("*.py"):
        for cited in re.findall(r"\bdocs/[\w./-]*\w", path.read_text()):
            assert (ROOT / cited).exists() or (ROOT / f"{cited}.md").exists(), f"{path}: cites {cited}"


def test_the_metrics_json_table_lists_every_field_in_order() -> None:
    """The fields come from RunSummary, its validation fields from the list of what validation computes
    (config/val_metrics.py): each of their rows says what its entry says, and each entry's TensorBoard tags are in
    the tags table."""
    page = _page("measurements.md")
    table = _table_after(page, "**`metrics.json`.** Every field")
    assert list(table) == list(FIELDS)
    for name, said in val_metrics.summary_docs().items():
        assert said in table[name], f"docs/measurements.md's row of {name} should say: {said}"
    tags = page.split("**`metrics.json`.**")[0]  # the TensorBoard table above it
    for metric in val_metrics.VAL_METRICS:
        assert all(f"`{val_metrics.tag(metric, ema)}`" in tags for ema in (False, True)), metric.key


def _relative_links(path: Path) -> list[str]:
    """The targets of the markdown links and images in `path` that point into the repository."""
    text = re.sub(r"```.*?```", "", path.read_text(), flags=re.S)  # code blocks hold no links
    targets = re.findall(r"\]\(([^)\s]+)\)", text)
    return [t for t in targets if not re.match(r"[a-z]+:", t) and not t.startswith("#")]


def test_readme_is_a_front_door() -> None:
    """At most README_MAX_LINES lines, and every relative link in it and in docs/*.md leads to a file."""
    assert len(README.splitlines()) <= README_MAX_LINES, "README.md is a front door: move the depth to docs/"
    for page in [ROOT / "README.md", *sorted(DOCS.glob("*.md"))]:
        for target in _relative_links(page):
            resolved = (page.parent / target.split("#", 1)[0]).resolve()
            if any(str(resolved.relative_to(ROOT)).startswith(skip) for skip in LINKS_NOT_CHECKED):
                continue
            assert resolved.exists(), f"{page.relative_to(ROOT)}: {target} does not exist"
    linked = {target.split("#", 1)[0] for target in _relative_links(ROOT / "README.md")}
    unlisted = [p.name for p in sorted(DOCS.glob("*.md")) if f"docs/{p.name}" not in linked]
    assert not unlisted, f"README.md's Documentation list lacks {unlisted}"
