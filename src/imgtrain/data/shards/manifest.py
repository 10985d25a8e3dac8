"""The manifest: what `imgtrain-shards` wrote, saved last, so a destination without it never looks complete.

LitData writes each split as `<root>/<split>/index.json` plus `chunk-*.bin` files. Its index has no room for
our metadata and LitData will "complete" a half-written split from per-worker index files, so the converter
writes `imgtrain-shards.json` at the root only after every split is written: the class names, each split's
sample count and the exact size of every file, the source's fingerprint (to refuse converting another dataset
into the same place) and the unreadable source files it skipped. Training reads it first and checks every
file's size against it, which finds a missing, truncated or swapped shard before any step.

Neither file is trusted: whoever can write the destination can write them. Every value is checked for its type,
every file name is confined to its split's folder (`chunk-<n>-<n>.bin` or `index.json`: LitData joins them into
cache paths), and LitData's index must ask for exactly the serializers the converter writes (`FIELDS`): the index
chooses each field's decoder, and some of LitData's (pickle among them) run code when they load.
"""

from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass, field, fields
from typing import Any

from imgtrain.common.atomic import BadJSON, read_json
from imgtrain.common.brief import brief
from imgtrain.common.errors import ConfigError, RunError
from imgtrain.data.shards.store import Store

MANIFEST = "imgtrain-shards.json"  # written last: its presence means the conversion finished
PARTIAL = ".imgtrain-shards.partial.json"  # during a conversion: the source's fingerprint and the splits done
FORMAT, VERSION = "imgtrain-shards", 1
SPLITS = ("train", "val")
INDEX = "index.json"  # LitData's index of a split
CHUNK = re.compile(r"chunk-\d+-\d+\.bin")  # LitData's chunk names, uncompressed: chunk-<worker>-<n>.bin
# What each sample holds, in the order the converter writes it, with the serializer LitData picks from the value's
# type: the one source of truth for the converter (`PackImage`) and for every check of an index.
FIELDS = {"index": "int", "label": "int", "path": "str", "image": "bytes"}
# The index settings that choose code besides `data_format`, as the converter leaves them.
_PLAIN = {"compression": None, "encryption": None, "item_loader": "PyTreeLoader"}
_UPDATED_AT = re.compile(r"\d+(\.\d+)?")  # LitData names a cache folder after it: a timestamp, nothing else
# How images were packed (`imgtrain-shards --max-side`, downscale.MaxSide.packing), as a manifest or partial file
# records it; this is every image as its file's bytes, and what a manifest written before --max-side means.
UNPACKED: dict[str, int | None] = {"max_side": None, "max_side_quality": None}


def file_name(name: object, where: str) -> str:
    """`name` when it is a file the converter writes in a split's folder, else one line: a name from a manifest or
    an index is joined into paths (the store, LitData's cache), so `../` or a folder would reach outside it."""
    if isinstance(name, str) and (name == INDEX or CHUNK.fullmatch(name)):
        return name
    raise RunError(f"{where} names the file {brief(name)}: a split holds only {INDEX} and chunk-<n>-<n>.bin files")


def _check_type(value: object, kind: type, what: str, where: str) -> None:
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise RunError(f"{where}: {what} is {brief(value)}, not {_KINDS[kind]}; convert the dataset again")


_KINDS = {int: "a whole number", str: "text", list: "a list", dict: "a mapping"}


@dataclass
class SplitFiles:
    """One split as written: its samples, every file's size in bytes (LitData's index included), and how many of
    its images were stored downscaled (--max-side)."""

    samples: int
    files: dict[str, int]
    downscaled: int = 0

    @classmethod
    def read(cls, raw: object, split: str, where: str) -> SplitFiles:
        """From a manifest or the partial file, every value checked (one line naming `where` otherwise)."""
        _check_type(raw, dict, f"the {split} split", where)
        _check_type(raw.get("samples"), int, f"the {split} split's sample count", where)
        _check_type(raw.get("files"), dict, f"the {split} split's files", where)
        for name, size in raw["files"].items():
            file_name(name, where)
            _check_type(size, int, f"the size of {split}/{name}", where)
        _check_type(raw.setdefault("downscaled", 0), int, f"the {split} split's downscaled count", where)
        if raw["samples"] < 0 or INDEX not in raw["files"] or not 0 <= raw["downscaled"] <= raw["samples"]:
            raise RunError(
                f"{where}: the {split} split lists no {INDEX}, a negative sample count or more images downscaled "
                "than samples"
            )
        return cls(raw["samples"], dict(raw["files"]), raw["downscaled"])

    @property
    def bytes(self) -> int:
        return sum(self.files.values())

    @property
    def shards(self) -> int:
        return sum(1 for name in self.files if name != INDEX)


@dataclass
class Manifest:
    classes: list[str]
    source: dict[str, Any]  # root, layout, val_fraction, split_seed, fingerprint
    engine: dict[str, str]  # name and version of the engine that wrote the shards
    chunk_bytes: int
    splits: dict[str, SplitFiles] = field(default_factory=dict)
    unreadable: dict[str, str] = field(default_factory=dict)  # source file -> why it was left out
    max_side: int | None = None  # --max-side: None (and in a manifest written before it), every image as its bytes
    max_side_quality: int | None = None  # the JPEG quality of the images downscaled, with max_side
    format: str = FORMAT
    version: int = VERSION

    @property
    def fingerprint(self) -> str:
        return self.source["fingerprint"]

    @property
    def packing(self) -> dict[str, int | None]:
        return {"max_side": self.max_side, "max_side_quality": self.max_side_quality}

    def packed(self) -> str:
        """How the images were packed, for the converter's report and the run's log."""
        if self.max_side is None:
            return f"packed {describe_packing(self.packing)}"
        shrunk = sum(files.downscaled for files in self.splits.values())
        total = sum(files.samples for files in self.splits.values())
        return (
            f"packed at --max-side {self.max_side} ({shrunk:,} of {total:,} images downscaled, JPEG quality "
            f"{self.max_side_quality})"
        )

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2) + "\n"

    @classmethod
    def from_json(cls, text: str, where: str) -> Manifest:
        try:
            raw = _parsed(text, where)
            if not isinstance(raw, dict) or raw.get("format") != FORMAT:
                raise ValueError(
                    f"format is {brief(raw.get('format') if isinstance(raw, dict) else raw)}, not {FORMAT!r}"
                )
            if raw.get("version") != VERSION:
                raise ValueError(f"version {brief(raw.get('version'))} (this imgtrain reads version {VERSION})")
            unknown = [key for key in raw if key not in {f.name for f in fields(cls)}]
            if unknown:
                raise ValueError(f"{brief(unknown[0])} is not a field of it")
            manifest = cls(**{**raw, "splits": {}})
        except (ValueError, TypeError) as error:
            raise RunError(f"{where} is not a manifest this imgtrain can read ({error})") from None
        return manifest._checked(raw.get("splits"), where)

    def _checked(self, splits: object, where: str) -> Manifest:
        """Every field of a manifest just read has its type ("classes": "abc" would be 3 classes), and both
        splits are there: one line naming the manifest and the field otherwise."""
        _check_type(self.classes, list, "classes", where)
        if not self.classes or not all(isinstance(name, str) for name in self.classes):
            raise RunError(f"{where}: classes is {brief(self.classes)}, not a list of class names; convert it again")
        for value, kind, what in (
            (self.source, dict, "source"),
            (self.engine, dict, "engine"),
            (self.chunk_bytes, int, "chunk_bytes"),
            (self.unreadable, dict, "unreadable"),
            (splits, dict, "splits"),
            *((value, int, what) for what, value in self.packing.items() if value is not None),
        ):
            _check_type(value, kind, what, where)
        for value, what in (
            (self.source.get("fingerprint"), "source.fingerprint"),
            *((self.engine.get(k), f"engine.{k}") for k in ("name", "version")),
        ):
            _check_type(value, str, what, where)
        missing = [split for split in SPLITS if split not in splits]
        if missing or set(splits) - set(SPLITS):
            raise RunError(f"{where}: splits are {sorted(splits)}, not {list(SPLITS)}; convert the dataset again")
        self.splits = {split: SplitFiles.read(splits[split], split, where) for split in SPLITS}
        return self


def describe_packing(packing: dict[str, Any]) -> str:
    """`packing` (a Manifest's, a partial file's, or MaxSide's) in words, for the converter's lines."""
    if packing.get("max_side") is None:
        return "as the source files' bytes (no --max-side)"
    return f"at --max-side {packing['max_side']} (JPEG quality {packing.get('max_side_quality')})"


def _parsed(text: str, where: str) -> Any:
    """`text` as JSON; a ValueError saying only what is wrong ("nested too deeply to parse", "not valid JSON: ..."),
    for the caller's line that names the file (json.loads: a RecursionError when nested 100,000 deep)."""
    try:
        return read_json(text, where)
    except BadJSON as error:
        raise ValueError(error.why) from None


def read_partial(text: str, where: str) -> dict[str, Any]:
    """The partial file of an unfinished conversion: {"fingerprint", "root", "done": {split: SplitFiles},
    "unreadable": {path: reason}, "packing": {...}} (UNPACKED when absent), every value checked; one line naming it
    otherwise."""
    try:
        state = _parsed(text, where)
        if not isinstance(state, dict):
            raise ValueError(f"it holds {type(state).__name__}, not a mapping")
        for value, kind, what in (
            (state.get("fingerprint"), str, "fingerprint"),
            (state.setdefault("root", ""), str, "root"),
            (state.setdefault("done", {}), dict, "done"),
            (state.setdefault("unreadable", {}), dict, "unreadable"),
            (state.setdefault("packing", dict(UNPACKED)), dict, "packing"),
        ):
            _check_type(value, kind, what, where)
        unknown = sorted(set(state["done"]) - set(SPLITS))
        if unknown:
            raise ValueError(f"{brief(unknown[0])} is not a split (expected {' or '.join(SPLITS)})")
        state["done"] = {split: SplitFiles.read(files, split, where) for split, files in state["done"].items()}
    except (ValueError, RunError) as error:  # DST holds what this converter cannot use: bad input, as a refusal
        why = str(error).removeprefix(f"{where}: ")
        raise ConfigError(
            f"{where} cannot be read ({why}), so the unfinished conversion there cannot be resumed: delete the "
            "destination and convert again"
        ) from None
    state["unreadable"] = {str(path): str(reason) for path, reason in state["unreadable"].items()}
    return state


def read_manifest(store: Store) -> Manifest:
    """The finished conversion at `store`, or one line saying why there is none."""
    where = store.location.join(MANIFEST)
    text = store.read_text(MANIFEST)
    if text is None:
        partial = store.read_text(PARTIAL) is not None
        why = "a conversion into it did not finish: run it again" if partial else "it holds no imgtrain shards"
        raise ConfigError(
            f"dataset.root={store.location.url} has no {MANIFEST} ({why}); write shards with "
            f"`imgtrain-shards <image folder> {store.location.url}`"
        )
    return Manifest.from_json(text, where)


def check_files(store: Store, manifest: Manifest, split: str) -> None:
    """Every file of `split` is present with the size the converter wrote, and no other chunk is: a missing,
    truncated or replaced shard is named in one line before training starts (one listing; no data is read)."""
    check_split(store, split, manifest.splits[split])


def check_split(store: Store, split: str, written: SplitFiles) -> None:
    """`check_files` for one split as the converter recorded it (the converter checks its own output with it)."""
    expected = written.files
    found = store.sizes(split)
    where = store.location.join(split)
    missing = sorted(name for name in expected if name not in found)
    wrong = sorted(name for name in expected if name in found and found[name] != expected[name])
    extra = sorted(name for name in found if name not in expected and name.endswith(".bin"))
    if missing:
        raise RunError(f"{where}: {len(missing)} shard file(s) missing, e.g. {missing[0]}; convert the dataset again")
    if wrong:
        name = wrong[0]
        raise RunError(
            f"{where}/{name} is {found[name]:,} bytes, the conversion wrote {expected[name]:,}: the shard is truncated "
            f"or was replaced ({len(wrong)} file(s) differ); copy it again or convert the dataset again"
        )
    if extra:
        raise RunError(f"{where}: {extra[0]} is not in {MANIFEST}: the shards do not match their index")
    _check_index(store, split, written)


def _check_index(store: Store, split: str, written: SplitFiles) -> None:
    """LitData's index names exactly the recorded chunks, counts the recorded samples, and reads them the way the
    converter wrote them (see the module docstring): before LitData reads any of it."""
    where = store.location.join(split, INDEX)
    try:
        index = _parsed(store.read_text(f"{split}/{INDEX}") or "{}", where)
        chunks, config = index["chunks"], index["config"]
        listed = {
            file_name(chunk["filename"], where): (_count(chunk["chunk_bytes"]), _count(chunk["chunk_size"]))
            for chunk in chunks
        }
    except (ValueError, KeyError, TypeError) as error:
        raise RunError(f"{where} cannot be read as LitData's index ({error}); convert the dataset again") from None
    _check_config(config, index.get("updated_at"), where)
    files = {name: size for name, size in written.files.items() if name != INDEX}
    samples = sum(count for _, count in listed.values())
    if set(listed) != set(files) or samples != written.samples:
        raise RunError(
            f"{where} does not match the shards it indexes ({len(listed)} chunks and {samples:,} samples listed; "
            f"{len(files)} chunks and {written.samples:,} samples written); convert the dataset again"
        )


def _count(value: object) -> int:
    """A chunk's bytes or samples as LitData counts them: a whole number (JSON's Infinity, a numeric string or a
    bool is not one); ValueError otherwise."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"a chunk's size is {brief(value)}, not a whole number")
    return value


def _check_config(config: object, updated_at: object, where: str) -> None:
    """The index's settings that choose code or paths are the converter's: one line naming the field otherwise."""
    if not isinstance(config, dict):
        raise RunError(f"{where}: its config is {brief(config)}, not LitData's settings; convert the dataset again")
    formats = config.get("data_format")
    if formats != list(FIELDS.values()):
        raise RunError(
            f"{where}: data_format is {brief(formats, 80)}: imgtrain shards hold {list(FIELDS.values())} "
            f"({', '.join(FIELDS)}), "
            "nothing else is read (some LitData formats, such as pickle, run code when they load); convert the "
            "dataset again with imgtrain-shards"
        )
    if _spec_fields(config.get("data_spec")) != list(FIELDS):
        raise RunError(f"{where}: data_spec does not describe the fields {list(FIELDS)}; convert the dataset again")
    for key, value in _PLAIN.items():
        if config.get(key) != value:
            raise RunError(
                f"{where}: {key} is {brief(config.get(key))}, imgtrain-shards writes {value!r}; convert again"
            )
    if updated_at is not None and not (isinstance(updated_at, str) and _UPDATED_AT.fullmatch(updated_at)):
        raise RunError(f"{where}: updated_at is {brief(updated_at)}, not a timestamp; convert the dataset again")


def _spec_fields(spec: object) -> list[str] | None:
    """The field names of LitData's serialized tree of a sample when it is a flat dict of plain leaves."""
    try:
        protocol, tree = read_json(spec, "data_spec")
        leaves = [
            child for child in tree["children_spec"] if child == {"type": None, "context": None, "children_spec": []}
        ]
        if protocol != 1 or tree["type"] != "builtins.dict" or len(leaves) != len(tree["children_spec"]):
            return None
        names = read_json(tree["context"], "data_spec's context")
        return names if len(names) == len(leaves) else None
    except (ValueError, TypeError, KeyError):
        return None
