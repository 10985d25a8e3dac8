"""The manifest: what `imgtrain-shards` wrote, saved last, so a destination without it never looks complete.

LitData writes each split as `<root>/<split>/index.json` plus `chunk-*.bin` files. Its index has no room for
our metadata and LitData will "complete" a half-written split from per-worker index files, so the converter
writes `imgtrain-shards.json` at the root only after every split is written: the class names, each split's
sample count and the exact size of every file, the source's fingerprint (to refuse converting another dataset
into the same place) and the unreadable source files it skipped. Training reads it first and checks every
file's size against it, which finds a missing, truncated or swapped shard before any step.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Any

from imgtrain.data.shards.store import Store
from imgtrain.errors import ConfigError, RunError

MANIFEST = "imgtrain-shards.json"  # written last: its presence means the conversion finished
PARTIAL = ".imgtrain-shards.partial.json"  # during a conversion: the source's fingerprint and the splits done
FORMAT, VERSION = "imgtrain-shards", 1
SPLITS = ("train", "val")
INDEX = "index.json"  # LitData's index of a split


@dataclass
class SplitFiles:
    """One split as written: its samples and every file's size in bytes (LitData's index included)."""

    samples: int
    files: dict[str, int]

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
    format: str = FORMAT
    version: int = VERSION

    @property
    def fingerprint(self) -> str:
        return self.source["fingerprint"]

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2) + "\n"

    @classmethod
    def from_json(cls, text: str, where: str) -> Manifest:
        try:
            raw = json.loads(text)
            if raw.get("format") != FORMAT:
                raise ValueError(f"format is {raw.get('format')!r}, not {FORMAT!r}")
            if raw.get("version") != VERSION:
                raise ValueError(f"version {raw.get('version')} (this imgtrain reads version {VERSION})")
            splits = {name: SplitFiles(**split) for name, split in raw.pop("splits").items()}
            return cls(**raw, splits=splits)
        except (ValueError, TypeError, KeyError, AttributeError) as error:
            raise RunError(f"{where} is not a manifest this imgtrain can read ({error})") from None


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
    expected = manifest.splits[split].files
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
    _check_index(store, manifest, split)


def _check_index(store: Store, manifest: Manifest, split: str) -> None:
    """LitData's index names exactly the manifest's chunks, with their sizes, and counts the manifest's samples."""
    where = store.location.join(split, INDEX)
    try:
        chunks = json.loads(store.read_text(f"{split}/{INDEX}") or "{}")["chunks"]
        listed = {chunk["filename"]: (int(chunk["chunk_bytes"]), int(chunk["chunk_size"])) for chunk in chunks}
    except (ValueError, KeyError, TypeError) as error:
        raise RunError(f"{where} cannot be read as LitData's index ({error}); convert the dataset again") from None
    files = {name: size for name, size in manifest.splits[split].files.items() if name != INDEX}
    samples = sum(count for _, count in listed.values())
    if set(listed) != set(files) or samples != manifest.splits[split].samples:
        raise RunError(
            f"{where} does not match the shards it indexes ({len(listed)} chunks and {samples:,} samples listed; "
            f"{len(files)} chunks and {manifest.splits[split].samples:,} samples written); convert the dataset again"
        )
