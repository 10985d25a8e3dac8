"""What `imgtrain-shards` finds at its destination before it packs anything: nothing; this source finished (nothing to
do, unless it was packed with another --max-side: then it is packed again); an unfinished conversion of it (its
intact splits kept when packed as this run packs); or anything else, refused in one line."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Any

from imgtrain.common.errors import ConfigError, RunError
from imgtrain.data.shards.manifest import (
    MANIFEST,
    PARTIAL,
    UNPACKED,
    Manifest,
    SplitFiles,
    check_split,
    describe_packing,
    read_partial,
)
from imgtrain.data.shards.source import Source
from imgtrain.data.shards.store import Store


@dataclass
class Plan:
    """What an earlier conversion into the destination left that this one keeps."""

    done: dict[str, SplitFiles] = field(default_factory=dict)  # splits finished and intact, packed as this run packs
    unreadable: dict[str, str] = field(default_factory=dict)  # the source files those splits left out
    finished: Manifest | None = None  # this very conversion, finished: nothing to do
    replaces: bool = False  # a finished conversion packed otherwise: its manifest goes before anything is written
    note: str | None = None  # what the converter says before it packs


def plan(store: Store, source: Source, fingerprint: str, packing: dict[str, Any]) -> Plan:
    """What to keep at `store` (see the module docstring); `packing`: this run's (downscale.MaxSide.packing)."""
    where = store.location.url
    text = store.read_text(MANIFEST)
    if text is not None:
        manifest = Manifest.from_json(text, store.location.join(MANIFEST))
        if manifest.fingerprint != fingerprint:
            raise ConfigError(
                f"DST={where} already holds shards of another dataset (from {manifest.source.get('root')}): choose "
                "another destination, or delete it first"
            )
        if manifest.packing == packing:
            return Plan(finished=manifest)
        return Plan(
            replaces=True,
            note=f"{where} holds this dataset packed {describe_packing(manifest.packing)}; this run packs it "
            f"{describe_packing(packing)}: packing both splits again",
        )
    partial = store.read_text(PARTIAL)
    if partial is not None:
        return _resumed(store, source, read_partial(partial, store.location.join(PARTIAL)), fingerprint, packing)
    if store.sizes():
        raise ConfigError(f"DST={where} is not empty and holds no imgtrain shards: choose an empty or new destination")
    return Plan()


def _resumed(store: Store, source: Source, state: dict[str, Any], fingerprint: str, packing: dict) -> Plan:
    """An unfinished conversion (`state`, the partial file) of this source: its intact splits, when they were packed
    as this run packs."""
    where = store.location.url
    if state["fingerprint"] != fingerprint:
        raise ConfigError(
            f"DST={where} holds an unfinished conversion of another dataset (from {state['root']}): choose "
            "another destination, or delete it first"
        )
    if {**UNPACKED, **state["packing"]} != packing:
        return Plan(
            note=f"an unfinished conversion into {where} packed {describe_packing(state['packing'])}; this one "
            f"packs {describe_packing(packing)}: starting it again from the start"
        )
    done = {split: files for split, files in state["done"].items() if _intact(store, split, files)}
    if not done:
        return Plan(note=f"an earlier conversion into {where} finished no split: starting it again from the start")
    kept = {source.relative(path) for split in done for path, _ in source.splits[split]}
    return Plan(
        done=done,
        unreadable={k: v for k, v in state["unreadable"].items() if k in kept},
        note=f"resuming an unfinished conversion into {where}: keeping {', '.join(done)} as written",
    )


def _intact(store: Store, split: str, files: SplitFiles) -> bool:
    """A split an earlier run finished is kept when it is still exactly as written and checked."""
    if store.sizes(split) != files.files:
        return False
    try:
        check_split(store, split, files)
    except RunError:
        return False
    return True


def save_partial(store: Store, state: dict, done: dict[str, SplitFiles]) -> None:
    """The partial file: `state` (fingerprint, root, unreadable files, packing) and the splits done."""
    store.write_text(PARTIAL, json.dumps({**state, "done": {split: asdict(files) for split, files in done.items()}}))
