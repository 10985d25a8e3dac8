"""`imgtrain-shards SRC DST` (and `make shards SRC=... DST=...`): pack an image folder into LitData shards.

SRC is what `dataset=imagefolder` reads: `train/` and `val/` class folders, or one folder of class folders that
is split by `--val-fraction` and `--split-seed` exactly as `dataset.val_fraction` and `dataset.split_seed` split
it. DST is a directory or `s3://bucket/prefix`. Each image is stored as its original file bytes (no re-encoding)
with its label, its index in the split and its path under SRC; decoding stays in the training pipeline.

Images are written in a seeded random order: LitData shuffles whole chunks and the samples inside each, so a
chunk written in class order would give batches of one or two classes. Each image is decoded once here; one that
cannot be is listed and left out. The manifest (`imgtrain-shards.json`) is written last, so a killed conversion
never looks complete; running the same command again keeps the splits already finished and redoes the others.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import multiprocessing
import os
import random
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import litdata
from tqdm import tqdm

from imgtrain.data import decoders
from imgtrain.data.decoders import decode_problem
from imgtrain.data.folders import folder_splits
from imgtrain.data.shards import engine
from imgtrain.data.shards.manifest import MANIFEST, PARTIAL, SPLITS, Manifest, SplitFiles
from imgtrain.data.shards.store import Location, Store
from imgtrain.errors import ConfigError, RunError
from imgtrain.host import available_cpus

# 64 MB chunks, LitData's own recommendation and MosaicML's default: one object-store request (tens of ms to its
# first byte) is spread over hundreds of ImageNet-sized JPEGs, while ImageNet's 140 GB still makes ~2,200 chunks,
# enough for every worker of every rank to get many (LitData deals whole chunks to workers and shuffles them).
DEFAULT_SHARD_MB = 64


@dataclass
class Source:
    """The image folder as `dataset=imagefolder` reads it, split the same way."""

    root: Path
    classes: list[str]
    splits: dict[str, list[tuple[str, int]]]  # split -> (path, label), in listing order
    layout: dict[str, object]

    @classmethod
    def read(cls, root: str, val_fraction: float, split_seed: int) -> Source:
        path = Path(os.path.abspath(os.path.expanduser(root)))
        if not path.is_dir():
            raise ConfigError(f"SRC={root} is not a directory: point it at an image folder (class folders of images)")
        (train, train_labels), (val, val_labels), classes = folder_splits(str(path), val_fraction, split_seed)
        folders = (path / "train").is_dir() and (path / "val").is_dir()
        layout: dict[str, object] = {"layout": "train/ and val/ folders"}
        if not folders:
            layout = {"layout": "one folder, split", "val_fraction": val_fraction, "split_seed": split_seed}
        splits = {"train": list(zip(train, train_labels, strict=True)), "val": list(zip(val, val_labels, strict=True))}
        return cls(path, classes, splits, layout)

    def fingerprint(self) -> str:
        """What identifies this source: the split, every file's path under SRC, label and size."""
        digest = hashlib.sha256(json.dumps({**self.layout, "classes": self.classes}, sort_keys=True).encode())
        for split in SPLITS:
            for path, label in self.splits[split]:
                digest.update(f"{split}\0{self.relative(path)}\0{label}\0{os.path.getsize(path)}\n".encode())
        return digest.hexdigest()

    def relative(self, path: str) -> str:
        return os.path.relpath(path, self.root)


class PackImage:
    """LitData's `fn`, in its worker processes: one source image as a sample, or None (left out) when it cannot
    be decoded. Unreadable files go to a per-process file in `report_dir`; `done` counts images for the bar."""

    def __init__(self, root: Path, report_dir: str, done) -> None:
        self.root, self.report_dir, self.done = root, report_dir, done

    def __call__(self, item: tuple[int, str, int]) -> dict | None:
        index, relative, label = item
        path = self.root / relative
        try:
            data = path.read_bytes()
            problem = decode_problem(data, str(path))
        except OSError as error:
            data, problem = b"", error.strerror or str(error)
        with self.done.get_lock():
            self.done.value += 1
        if problem:
            with open(os.path.join(self.report_dir, f"{os.getpid()}.tsv"), "a") as report:
                report.write(f"{relative}\t{problem}\n")
            return None
        return {"index": index, "label": label, "path": relative, "image": data}


def _unreadable(report_dir: str) -> dict[str, str]:
    found: dict[str, str] = {}
    for name in sorted(os.listdir(report_dir)):
        for line in Path(report_dir, name).read_text().splitlines():
            relative, _, reason = line.partition("\t")
            found[relative] = reason
    return found


@contextlib.contextmanager
def _progress(done, total: int, split: str) -> Iterator[None]:
    """A bar with images/s, fed by the workers' shared counter (LitData's own bar moves only when a worker ends)."""
    bar = tqdm(total=total, desc=f"packing {split}", unit="img", dynamic_ncols=True, file=sys.stdout)
    stop = threading.Event()

    def follow() -> None:
        while not stop.wait(0.5):
            bar.update(done.value - bar.n)

    thread = threading.Thread(target=follow, daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()
        bar.update(done.value - bar.n)
        bar.close()


def pack_split(source: Source, store: Store, split: str, shard_mb: int, workers: int, seed: int) -> dict[str, str]:
    """Write one split with LitData's `optimize`; returns the unreadable files it left out (path -> reason)."""
    items = [(index, source.relative(path), label) for index, (path, label) in enumerate(source.splits[split])]
    random.Random(seed).shuffle(items)  # chunks must mix classes (see the module docstring)
    done = multiprocessing.get_context("fork").Value("q", 0)
    with tempfile.TemporaryDirectory(prefix="imgtrain-shards-") as scratch, _progress(done, len(items), split):
        report_dir = os.path.join(scratch, "unreadable")
        os.makedirs(report_dir)
        # LitData stages chunks bound for object storage in one fixed folder (/tmp/chunks) by default: a private
        # one keeps two conversions apart. Local destinations are written in place.
        with engine.scratch_env(os.path.join(scratch, "chunks")):
            litdata.optimize(
                fn=PackImage(source.root, report_dir, done),
                inputs=items,
                output_dir=store.location.join(split),
                chunk_bytes=shard_mb * 1_000_000,
                num_workers=max(1, min(workers, len(items))),
                reorder_files=False,  # keep the shuffled order
                keep_data_ordered=True,
                start_method="fork",  # the workers inherit `done` (and need no re-import of this module)
                storage_options=engine.storage_options(store.timeout_s),
                verbose=False,
            )
        return _unreadable(report_dir)


# ----------------------------------------------------------------------------- the destination
def _plan(store: Store, fingerprint: str) -> tuple[dict[str, dict], Manifest | None]:
    """(splits already finished by an earlier run of this conversion, a finished manifest if any); refuses a
    destination that holds anything else."""
    where = store.location.url
    text = store.read_text(MANIFEST)
    if text is not None:
        manifest = Manifest.from_json(text, store.location.join(MANIFEST))
        if manifest.fingerprint != fingerprint:
            raise ConfigError(
                f"DST={where} already holds shards of another dataset (from {manifest.source.get('root')}): choose "
                "another destination, or delete it first"
            )
        return {}, manifest
    partial = store.read_text(PARTIAL)
    if partial is not None:
        state = json.loads(partial)
        if state.get("fingerprint") != fingerprint:
            raise ConfigError(
                f"DST={where} holds an unfinished conversion of another dataset (from {state.get('root')}): choose "
                "another destination, or delete it first"
            )
        done = {
            split: files
            for split, files in state.get("done", {}).items()
            if store.sizes(split) == files["files"]  # still exactly as written
        }
        return done, None
    if store.sizes():
        raise ConfigError(f"DST={where} is not empty and holds no imgtrain shards: choose an empty or new destination")
    return {}, None


def convert(src: str, dst: str, *, val_fraction: float, split_seed: int, shard_mb: int, workers: int) -> Manifest:
    """Pack SRC into DST (see the module docstring); prints what it does and returns the manifest."""
    decoders.check("imgtrain-shards")  # every image is decoded once, as training will, before it is packed
    source = Source.read(src, val_fraction, split_seed)
    store = Store(Location.parse(dst, key="DST"))
    store.check_reachable(create=True)
    fingerprint = source.fingerprint()
    done, finished = _plan(store, fingerprint)
    if finished is not None:
        print(f"{store.location.url} already holds this dataset, converted from {source.root}: nothing to do")
        return finished
    state = {"fingerprint": fingerprint, "root": str(source.root), "done": done}
    if done:
        print(f"resuming an unfinished conversion into {store.location.url}: keeping {', '.join(done)} as written")
    elif store.read_text(PARTIAL) is not None:
        print(f"an earlier conversion into {store.location.url} finished no split: starting it again from the start")
    store.write_text(PARTIAL, json.dumps(state))
    unreadable: dict[str, str] = dict(json.loads(store.read_text(PARTIAL) or "{}").get("unreadable", {}))
    for split in SPLITS:
        if split in done:
            continue
        store.remove(split)  # whatever a killed run left of this split
        skipped = pack_split(source, store, split, shard_mb, workers, split_seed)
        for relative, reason in skipped.items():
            print(f"  unreadable, left out: {relative}: {reason}")
        unreadable.update(skipped)
        written = len(source.splits[split]) - len(skipped)
        if written == 0:
            raise RunError(f"SRC={src}: no readable image in the {split} split ({len(skipped)} unreadable)")
        done[split] = {"samples": written, "files": store.sizes(split)}
        store.write_text(PARTIAL, json.dumps({**state, "done": done, "unreadable": unreadable}))
    manifest = Manifest(
        classes=source.classes,
        source={"root": str(source.root), **source.layout, "fingerprint": fingerprint},
        engine=engine.identity(),
        chunk_bytes=shard_mb * 1_000_000,
        splits={split: SplitFiles(**done[split]) for split in SPLITS},
        unreadable=unreadable,
    )
    store.write_text(MANIFEST, manifest.to_json())  # last: from now on the destination is complete
    store.delete(PARTIAL)
    return manifest


def report(manifest: Manifest, dst: str) -> str:
    """What was written, and the command that trains on it."""
    lines = [f"{dst}: {manifest.engine['name']} {manifest.engine['version']} shards of {len(manifest.classes)} classes"]
    for split in SPLITS:
        files = manifest.splits[split]
        lines.append(
            f"  {split:5s} {files.samples:>10,} samples {files.shards:>6,} shards {files.bytes / 1e9:>9.3f} GB"
        )
    if manifest.unreadable:
        lines.append(f"  {len(manifest.unreadable)} unreadable source file(s) left out (listed in {MANIFEST})")
    lines.append(f"train on it:  python train.py dataset=shards dataset.root={dst}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="imgtrain-shards", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("src", metavar="SRC", help="an image folder, as dataset=imagefolder reads it")
    parser.add_argument("dst", metavar="DST", help="a directory or s3://bucket/prefix")
    parser.add_argument("--val-fraction", type=float, default=0.1, help="without val/: as dataset.val_fraction")
    parser.add_argument("--split-seed", type=int, default=0, help="without val/: as dataset.split_seed")
    parser.add_argument("--shard-mb", type=int, default=DEFAULT_SHARD_MB, help="largest shard, in MB (default 64)")
    parser.add_argument("--workers", type=int, default=available_cpus(), help="processes (default: every CPU)")
    args = parser.parse_args(argv)
    if not 0.0 < args.val_fraction < 1.0 or args.shard_mb < 1 or args.workers < 1:
        parser.error("--val-fraction must lie in (0, 1); --shard-mb and --workers must be at least 1")
    started = time.perf_counter()
    try:
        manifest = convert(
            args.src,
            args.dst,
            val_fraction=args.val_fraction,
            split_seed=args.split_seed,
            shard_mb=args.shard_mb,
            workers=args.workers,
        )
    except RunError as error:
        print(f"error: {error}", file=sys.stderr, flush=True)
        return 2 if isinstance(error, ConfigError) else 1
    except KeyboardInterrupt:
        print(
            f"\nstopped: {args.dst} has no {MANIFEST}, so nothing there looks complete; run the same command again "
            "to continue (finished splits are kept)",
            file=sys.stderr,
            flush=True,
        )
        return 130
    print(report(manifest, args.dst))
    print(f"({time.perf_counter() - started:.1f} s)")
    return 0


if __name__ == "__main__":  # python -m imgtrain.data.shards.convert SRC DST (imgtrain-shards checks LitData first)
    sys.exit(main())
