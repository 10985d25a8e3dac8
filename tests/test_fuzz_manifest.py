"""Fuzz targets for what a shards destination holds besides the images (data/shards/manifest.py): the manifest
(imgtrain-shards.json), the partial file of an unfinished conversion, and LitData's index.json of each split, all
written by whoever can write the destination. Seeded from fuzz_seeds/manifest/ (a real conversion's files, a
--max-side manifest, a partial file; and what targets found: an index whose chunk_bytes was Infinity, which raised
OverflowError, manifests whose unknown key or format held a line break, which the one-line error then held, and
one that is not UTF-8, whose UnicodeDecodeError reached the command line),
mutated byte by byte and field by field (data_spec, JSON inside the index's JSON, too). The properties:
- each read ends in a value or in the one-line error it documents (RunError for the manifest and the index,
  ConfigError for the partial file), within the bound;
- a manifest read is written back (to_json) to the same manifest, and says how it was packed;
- the real index passes the check, against its files as the manifest recorded them.
"""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

import pytest
from fuzzing import bounded, fast, json_text, mutated, mutated_tree, seed_files, slow
from hypothesis import given
from hypothesis import strategies as st

pytest.importorskip("boto3", reason="the shards manifest needs the shards extra: pip install -e '.[shards]'")

from imgtrain.common.errors import ConfigError, RunError  # noqa: E402
from imgtrain.data.shards.manifest import (  # noqa: E402
    INDEX,
    Manifest,
    SplitFiles,
    check_split,
    read_manifest,
    read_partial,
)
from imgtrain.data.shards.store import Location, Store  # noqa: E402

SEEDS = seed_files("manifest")
# imgtrain-shards.json and max_side.json: real ones; manifest.<what>.json: one a target found a crash with
MANIFESTS = [SEEDS["imgtrain-shards.json"], SEEDS["max_side.json"]]
FOUND = {name: data for name, data in SEEDS.items() if name.startswith("manifest.")}
# <split>.index.json: a real conversion's; <split>.<what>.index.json: one a target found a crash with (regressions)
INDEXES = [data for name, data in SEEDS.items() if name.endswith(".index.json")]
CHUNK_BYTES = {"train": 6782, "val": 1364}  # the seed conversion's chunk-0-0.bin of each split


def _one_line(error: BaseException, where: str) -> None:
    assert "\n" not in str(error) and where in str(error), error


def manifest_target(text: str | bytes) -> None:
    text = text.decode("utf-8", "replace") if isinstance(text, bytes) else text
    try:
        with bounded("reading a manifest"):
            manifest = Manifest.from_json(text, "dst/imgtrain-shards.json")
    except RunError as error:
        _one_line(error, "dst/imgtrain-shards.json")
        return
    with bounded("writing it back"):
        again = Manifest.from_json(manifest.to_json(), "again")
        assert json.loads(json_text(asdict(again))) == json.loads(json_text(asdict(manifest)))
        assert manifest.packed().startswith("packed ")


def stored_manifest_target(folder: Path, data: bytes) -> None:
    """The manifest's bytes as a destination holds them, read as training reads them (read_manifest)."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "imgtrain-shards.json").write_bytes(data)
    try:
        with bounded("reading a stored manifest"):
            read_manifest(Store(Location.parse(str(folder))))
    except (RunError, ConfigError) as error:
        _one_line(error, str(folder / "imgtrain-shards.json"))


def partial_target(text: str | bytes) -> None:
    text = text.decode("utf-8", "replace") if isinstance(text, bytes) else text
    try:
        with bounded("reading a partial file"):
            state = read_partial(text, "dst/.partial")
    except ConfigError as error:
        _one_line(error, "dst/.partial")
        return
    assert all(isinstance(files, SplitFiles) for files in state["done"].values())
    assert all(isinstance(k, str) and isinstance(v, str) for k, v in state["unreadable"].items())


def index_target(folder: Path, split: str, data: bytes) -> None:
    """The index of `split` as `data`, beside a chunk of the size the manifest recorded: only RunError."""
    (folder / split).mkdir(parents=True, exist_ok=True)
    (folder / split / INDEX).write_bytes(data)
    with open(folder / split / "chunk-0-0.bin", "wb") as chunk:
        chunk.truncate(CHUNK_BYTES[split])
    written = SplitFiles(10 if split == "train" else 2, {INDEX: len(data), "chunk-0-0.bin": CHUNK_BYTES[split]})
    try:
        with bounded("checking an index"):
            check_split(Store(Location.parse(str(folder))), split, written)
    except RunError as error:
        _one_line(error, str(folder / split))


def _trees(seeds: list[bytes]) -> st.SearchStrategy[str]:
    return st.sampled_from(seeds).flatmap(lambda seed: mutated_tree(json.loads(seed))).map(json_text)


@st.composite
def _index_specs(draw: st.DrawFn) -> str:
    """An index whose data_spec (JSON in a JSON string) is mutated as a tree."""
    index = json.loads(draw(st.sampled_from(INDEXES)))
    index["config"]["data_spec"] = json_text(draw(mutated_tree(json.loads(index["config"]["data_spec"]))))
    return json_text(index)


MANIFEST_INPUTS = st.one_of(mutated([*MANIFESTS, *FOUND.values()]), _trees(MANIFESTS))
PARTIAL_INPUTS = st.one_of(mutated([SEEDS["partial.json"]]), _trees([SEEDS["partial.json"]]))
INDEX_INPUTS = st.one_of(mutated(INDEXES), _trees(INDEXES), _index_specs()).map(
    lambda text: text.encode() if isinstance(text, str) else text
)


@fast()
@given(MANIFEST_INPUTS)
def test_a_manifest_reads_back_or_is_one_line(text: str | bytes) -> None:
    manifest_target(text)


@fast()
@given(mutated([*MANIFESTS, *FOUND.values()]))
def test_a_manifest_as_stored_reads_or_is_one_line(tmp_path: Path, data: bytes) -> None:
    stored_manifest_target(tmp_path / "dst", data)


@fast()
@given(PARTIAL_INPUTS)
def test_a_partial_file_reads_or_is_one_line(text: str | bytes) -> None:
    partial_target(text)


@fast()
@given(st.sampled_from(["train", "val"]), INDEX_INPUTS)
def test_an_index_checks_or_is_one_line(tmp_path: Path, split: str, data: bytes) -> None:
    index_target(tmp_path, split, data)


def test_the_seeds_read_and_check(tmp_path: Path) -> None:
    for seed in MANIFESTS:
        manifest_target(seed)
        Manifest.from_json(seed.decode(), "seed")
    for name, seed in FOUND.items():  # a key or a format holding a line break (the message held it too), bytes
        (tmp_path / name).mkdir()  # not UTF-8 (UnicodeDecodeError)
        (tmp_path / name / "imgtrain-shards.json").write_bytes(seed)
        with pytest.raises(RunError) as caught:
            read_manifest(Store(Location.parse(str(tmp_path / name))))
        said = str(caught.value)
        assert "\n" not in said and said.startswith(str(tmp_path / name / "imgtrain-shards.json")), said
        assert " is not a manifest this imgtrain can read (" in said or " is not UTF-8 text (" in said, said
    read_partial(SEEDS["partial.json"].decode(), "seed")
    for name, data in SEEDS.items():
        if not name.endswith(".index.json"):
            continue
        split = name.split(".")[0]
        index_target(tmp_path, split, data)
        written = SplitFiles(10 if split == "train" else 2, {INDEX: len(data), "chunk-0-0.bin": CHUNK_BYTES[split]})
        if name == f"{split}.index.json":  # a real one passes: no error at all
            check_split(Store(Location.parse(str(tmp_path))), split, written)
        else:
            with pytest.raises(RunError, match="not a whole number"):
                check_split(Store(Location.parse(str(tmp_path))), split, written)


@pytest.mark.slow  # a few minutes: each target on SLOW examples
def test_the_manifest_targets_on_a_larger_budget(tmp_path: Path) -> None:
    slow()(given(MANIFEST_INPUTS)(manifest_target))()
    slow()(given(mutated([*MANIFESTS, *FOUND.values()]))(lambda data: stored_manifest_target(tmp_path / "d", data)))()
    slow()(given(PARTIAL_INPUTS)(partial_target))()
    slow()(given(st.sampled_from(["train", "val"]), INDEX_INPUTS)(lambda s, d: index_target(tmp_path, s, d)))()
