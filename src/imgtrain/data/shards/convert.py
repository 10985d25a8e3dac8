"""`imgtrain-shards SRC DST` (and `make shards SRC=... DST=...`): pack an image folder, or a CSV per split, into
LitData shards.

SRC is what `dataset=imagefolder` reads: `train/` and `val/` class folders, or one folder of class folders that
is split by `--val-fraction` and `--split-seed` exactly as `dataset.val_fraction` and `dataset.split_seed` split
it. Or what `dataset=csv` reads: SRC the training split's CSV (or TSV) and `--val` the validation split's
(source.py). DST is a directory or `s3://bucket/prefix`. Each image is stored as its original file bytes (no
re-encoding) with its label, its index in the split and its path under SRC (a CSV's folder); decoding stays in the
training pipeline. With `--max-side N`, an image whose longer side is above N is stored downscaled to N, upright,
as a JPEG (downscale.py), in the same worker processes; the manifest records N, and a conversion packed with
another --max-side is packed again rather than kept.

Images are written in a seeded random order: LitData shuffles whole chunks and the samples inside each, so a
chunk written in class order would give batches of one or two classes. Each image is decoded once here (one
above --max-side twice: checked as training decodes it, then downscaled by PIL); one that cannot be, or whose
header claims more pixels than --max-image-pixels (dataset.max_image_pixels' default unless given), is listed and
left out; so is a path that is not a regular file (data/reads.py). No image packed for --stall-timeout seconds
stops the conversion in one line naming the files in hand (progress.py). The manifest (`imgtrain-shards.json`)
is written last, so a killed conversion never looks complete; running the same command again keeps the splits
already finished and redoes the others.
Each split is checked as training will check it (manifest.check_split) as soon as it is written. Files are staged
in one folder per destination, removed however the conversion stops (staging.py).
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import random
import signal
import sys
import time
from pathlib import Path

import litdata
import torch

from imgtrain.common.errors import ConfigError, RunError
from imgtrain.config.datasets import MAX_IMAGE_PIXELS
from imgtrain.data import decoders
from imgtrain.data.decoders import DECODE_ERRORS, decode_problem, error_reason
from imgtrain.data.reads import read_bytes
from imgtrain.data.shards import engine, staging
from imgtrain.data.shards.arguments import pixel_limit, whole_number
from imgtrain.data.shards.destination import plan, save_partial
from imgtrain.data.shards.downscale import AS_STORED, QUALITY, MaxSide
from imgtrain.data.shards.manifest import FIELDS, MANIFEST, PARTIAL, SPLITS, Manifest, SplitFiles, check_split
from imgtrain.data.shards.progress import STALL_S, Busy, progress
from imgtrain.data.shards.source import Source
from imgtrain.data.shards.store import Location, Store, redact
from imgtrain.host.cpus import available_cpus

# 64 MB chunks, LitData's own recommendation and MosaicML's default: one object-store request (tens of ms to its
# first byte) is spread over hundreds of ImageNet-sized JPEGs, while ImageNet's 140 GB still makes ~2,200 chunks,
# enough for every worker of every rank to get many (LitData deals whole chunks to workers and shuffles them).
DEFAULT_SHARD_MB = 64


class PackFailed(RuntimeError):
    """An error PackImage did not expect, raised with the file it was packing (LitData reports only the message)."""


class PackImage:
    """LitData's `fn`, in its worker processes: one source image as a sample, or None (left out) when it cannot
    be decoded (or is above `max_pixels`, as training would find it). Unreadable files go to a per-process file in
    `report_dir`; `done` counts images for the bar. With `max_side.side` (--max-side), an image larger than that
    is stored downscaled (downscale.py) and counted in `shrunk`; any other as its bytes."""

    def __init__(self, root: Path, report_dir: str, done, max_pixels: int | None = MAX_IMAGE_PIXELS,
                 max_side: MaxSide = AS_STORED, shrunk=None) -> None:  # fmt: skip
        self.root, self.report_dir, self.done, self.max_pixels = root, report_dir, done, max_pixels
        self.max_side, self.shrunk = max_side, shrunk
        self.parent, self.busy = os.getpid(), Busy(report_dir)  # the file in hand, for --stall-timeout's line

    def __call__(self, item: tuple[int, str, int]) -> dict | None:
        if os.getpid() != self.parent and torch.get_num_threads() != 1:
            # In LitData's forked worker, before its first decode: one intra-op thread, as torch's DataLoader sets in
            # its workers. A parent that had already run a parallel kernel (OpenMP's pool started) left a pool the
            # child cannot use: the child's first multi-threaded op waited forever (seen in the test suite)
            torch.set_num_threads(1)
        try:
            return self._packed(*item)
        except Exception as error:  # LitData reports a worker's error by its message alone: it names the file here
            reason, kind = error_reason(error), type(error).__name__
            raise PackFailed(f"{item[1]}: {reason if reason == kind else f'{kind}: {reason}'}") from error

    def _packed(self, index: int, relative: str, label: int) -> dict | None:
        path = self.root / relative
        self.busy.on(relative)
        try:
            data = bytes(read_bytes(str(path), self.max_pixels))  # a regular file, its size and the cap at most
            problem = decode_problem(data, str(path), self.max_pixels)
        except OSError as error:
            data, problem = b"", error.strerror or str(error)
        if not problem and self.max_side.side is not None:  # here, so that it runs in --workers processes
            data, problem = self._sized(data)
        self.busy.off()
        with self.done.get_lock():
            self.done.value += 1
        if problem:
            with open(os.path.join(self.report_dir, f"{os.getpid()}.tsv"), "a") as report:
                report.write(f"{relative}\t{problem}\n")
            return None
        return dict(zip(FIELDS, (index, label, relative, data), strict=True))  # what training accepts, and only that

    def _sized(self, data: bytes) -> tuple[bytes, str | None]:
        """(what to store of the image file `data`, why it cannot be stored or None)."""
        try:
            smaller = self.max_side.shrunk(data, self.max_pixels)
        except DECODE_ERRORS as error:  # training's decoder read it, PIL cannot: left out as unreadable
            return data, f"cannot be downscaled to --max-side {self.max_side.side} ({error_reason(error)})"
        if smaller is None:
            return data, None
        with self.shrunk.get_lock():
            self.shrunk.value += 1
        return smaller, None


def _unreadable(report_dir: str) -> dict[str, str]:
    found: dict[str, str] = {}
    for name in sorted(name for name in os.listdir(report_dir) if name.endswith(".tsv")):
        for line in Path(report_dir, name).read_text().splitlines():
            relative, _, reason = line.partition("\t")
            found[relative] = reason
    return found


def pack_split(
    source: Source,
    store: Store,
    split: str,
    shard_mb: int,
    workers: int,
    seed: int,
    scratch: str,
    max_pixels: int | None,
    max_side: MaxSide = AS_STORED,
    stall_s: float = STALL_S,
) -> tuple[dict[str, str], int]:
    """Write one split with LitData's `optimize`, staging under `scratch`; returns the unreadable files it left
    out (path -> reason), those above `max_pixels` (--max-image-pixels) included, and how many images it stored
    downscaled to `max_side` (--max-side). No image packed for `stall_s` seconds (--stall-timeout) is one line."""
    items = [(index, source.relative(path), label) for index, (path, label) in enumerate(source.splits[split])]
    random.Random(seed).shuffle(items)  # chunks must mix classes (see the module docstring)
    done, shrunk = (multiprocessing.get_context("fork").Value("q", 0) for _ in range(2))
    report_dir = os.path.join(scratch, split, "unreadable")
    os.makedirs(report_dir)
    before = engine.started_processes()
    # LitData stages chunks bound for object storage in one fixed folder (/tmp/chunks) by default: a private one
    # keeps two conversions apart. Local destinations are written in place.
    watching = progress(done, len(items), split, stall_s, report_dir)
    with watching as watch, engine.scratch_env(os.path.join(scratch, split, "chunks")):
        try:
            litdata.optimize(
                fn=PackImage(source.root, report_dir, done, max_pixels, max_side, shrunk),
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
        except BaseException as error:  # a stop or LitData's error: its workers would go on writing
            engine.stop_processes(before)
            if watch.stalled:  # the bar's thread interrupted it
                raise RunError(f"{store.location.join(split)}: {watch.stalled}; run the same command again") from None
            if isinstance(error, Exception) and not isinstance(error, RunError):
                raise _engine_error(store.location.join(split), error) from None
            raise
    return _unreadable(report_dir), shrunk.value


def _engine_error(url: str, error: Exception) -> RunError:
    """One line for LitData failing to write a split: it reports a worker's error with the worker's traceback in
    the message ("We found the following error Traceback ... ."): PackImage's own line where there is one (it names
    the file), else the traceback's last exception line."""
    lines = [line.strip() for line in str(error).strip().splitlines() if line.strip().strip(".")]
    named = [line.split(f"{PackFailed.__name__}: ", 1)[1] for line in lines if f"{PackFailed.__name__}: " in line]
    reason = named[-1] if named else lines[-1].rstrip(".") if lines else type(error).__name__
    return RunError(redact(f"{url}: LitData could not write the split ({reason}); run the same command again"))


def convert(
    src: str, dst: str, *, val_fraction: float, split_seed: int, shard_mb: int, workers: int, val: str | None = None,
    max_pixels: int | None = MAX_IMAGE_PIXELS, max_side: MaxSide = AS_STORED, stall_s: float = STALL_S,
) -> Manifest:  # fmt: skip
    """Pack SRC into DST (see the module docstring); prints what it does and returns the manifest."""
    decoders.check("imgtrain-shards")  # every image is decoded once, as training will, before it is packed
    source = Source.read(src, val_fraction, split_seed, val)
    store = Store(Location.parse(dst, key="DST"))
    store.check_reachable(create=True)
    fingerprint = source.fingerprint()
    earlier = plan(store, source, fingerprint, max_side.packing)
    if earlier.finished is not None:
        print(f"{store.location.url} already holds this dataset, converted from {source.root}: nothing to do")
        return earlier.finished
    if earlier.note:
        print(earlier.note)
    done = earlier.done
    state = {"fingerprint": fingerprint, "root": str(source.root), "unreadable": earlier.unreadable}
    state["packing"] = max_side.packing  # a run packing otherwise keeps none of these splits (destination.py)
    with staging.staging(store.location.url, store.endpoint) as scratch:  # from here, no other conversion into DST
        if earlier.replaces:  # the partial file first: from the manifest's removal on, nothing looks complete
            save_partial(store, state, done)
            store.delete(MANIFEST)
        for split in SPLITS:
            if split not in done:
                how = (shard_mb, workers, split_seed, scratch, max_pixels, max_side, stall_s)
                done[split] = _write_split(source, store, split, state, done, how)
    manifest = Manifest(
        classes=source.classes,
        source={"root": str(source.root), **source.layout, "fingerprint": fingerprint},
        engine=engine.identity(),
        chunk_bytes=shard_mb * 1_000_000,
        splits={split: done[split] for split in SPLITS},
        unreadable=state["unreadable"],
        **max_side.packing,
    )
    store.write_text(MANIFEST, manifest.to_json())  # last: from now on the destination is complete
    store.delete(PARTIAL)
    return manifest


def _write_split(source: Source, store: Store, split: str, state: dict, done: dict, how: tuple) -> SplitFiles:
    """Pack one split, check it as training will, and record it in the partial file (`state` gains its unreadable
    files). `how`: (shard_mb, workers, seed, staging folder, max_pixels, max_side, stall_s)."""
    save_partial(store, state, done)  # before anything is written: this destination is being converted
    store.remove(split)  # whatever a killed run left of this split
    skipped, shrunk = pack_split(source, store, split, *how)
    for relative, reason in skipped.items():
        print(f"  unreadable, left out: {relative}: {reason}")
    state["unreadable"].update(skipped)
    written = len(source.splits[split]) - len(skipped)
    if written == 0:
        raise RunError(f"SRC={source.root}: no readable image in the {split} split ({len(skipped)} unreadable)")
    files = SplitFiles(written, store.sizes(split), shrunk)
    check_split(store, split, files)  # the converter and training agree on what a split is
    save_partial(store, state, {**done, split: files})
    return files


def report(manifest: Manifest, dst: str) -> str:
    """What was written, and the command that trains on it."""
    lines = [f"{dst}: {manifest.engine['name']} {manifest.engine['version']} shards of {len(manifest.classes)} classes"]
    for split in SPLITS:
        files = manifest.splits[split]
        lines.append(
            f"  {split:5s} {files.samples:>10,} samples {files.shards:>6,} shards {files.bytes / 1e9:>9.3f} GB"
        )
    lines.append(f"  {manifest.packed()}")
    if manifest.unreadable:
        lines.append(f"  {len(manifest.unreadable)} unreadable source file(s) left out (listed in {MANIFEST})")
    lines.append(f"train on it:  python train.py dataset=shards dataset.root={dst}")
    return "\n".join(lines)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="imgtrain-shards", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("src", metavar="SRC", help="an image folder (as dataset=imagefolder reads it), or a CSV")
    parser.add_argument("dst", metavar="DST", help="a directory or s3://bucket/prefix")
    parser.add_argument("--val", metavar="CSV", help="with a CSV SRC: the validation split's CSV (as dataset.val)")
    parser.add_argument("--val-fraction", type=float, default=0.1, help="without val/: as dataset.val_fraction")
    parser.add_argument("--split-seed", type=int, default=0, help="without val/: as dataset.split_seed")
    parser.add_argument("--shard-mb", type=int, default=DEFAULT_SHARD_MB, help="largest shard, in MB (default 64)")
    parser.add_argument("--workers", type=int, default=available_cpus(), help="processes (default: every CPU)")
    parser.add_argument(
        "--max-image-pixels",
        type=pixel_limit,
        default=MAX_IMAGE_PIXELS,
        help=f"as dataset.max_image_pixels: a file whose header claims more is left out (default {MAX_IMAGE_PIXELS}, "
        "PIL's limit; none = no limit)",
    )
    parser.add_argument(
        "--max-side",
        type=whole_number(1, None, "pixels"),
        metavar="N",
        help="store an image whose longer side is above N px downscaled to N, upright, as a JPEG; any other as its "
        "file's bytes (default: every image as its bytes)",
    )
    quality = f"with --max-side: the downscaled images' JPEG quality (default {QUALITY})"
    stall = f"stop when no image has been packed for S seconds, naming the files in hand (default {STALL_S}; 0: never)"
    seconds = whole_number(0, None, "seconds")
    parser.add_argument("--stall-timeout", type=seconds, default=STALL_S, metavar="S", help=stall)
    parser.add_argument("--max-side-quality", type=whole_number(1, 100, "a JPEG quality"), metavar="Q", help=quality)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if not 0.0 < args.val_fraction < 1.0 or args.shard_mb < 1 or args.workers < 1:
        parser.error("--val-fraction must lie in (0, 1); --shard-mb and --workers must be at least 1")
    if args.max_side_quality is not None and args.max_side is None:
        parser.error("--max-side-quality applies only with --max-side N (images are otherwise stored as their bytes)")
    max_side = MaxSide(args.max_side, args.max_side_quality or QUALITY)
    started = time.perf_counter()
    try:
        with staging.stops():  # SIGTERM and SIGHUP unwind like Ctrl-C: the staging folder is removed
            manifest = convert(
                args.src,
                args.dst,
                val_fraction=args.val_fraction,
                val=args.val,
                split_seed=args.split_seed,
                shard_mb=args.shard_mb,
                workers=args.workers,
                max_pixels=args.max_image_pixels,
                max_side=max_side,
                stall_s=args.stall_timeout,
            )
    except RunError as error:
        print(f"error: {error}", file=sys.stderr, flush=True)
        return 2 if isinstance(error, ConfigError) else 1
    except KeyboardInterrupt as stop:
        print(
            f"\nstopped: {args.dst} has no {MANIFEST}, so nothing there looks complete; run the same command again "
            "to continue (finished splits are kept)",
            file=sys.stderr,
            flush=True,
        )
        return 128 + getattr(stop, "signum", signal.SIGINT)  # the shell's status for a stop by that signal
    print(report(manifest, args.dst))
    print(f"({time.perf_counter() - started:.1f} s)")
    return 0


if __name__ == "__main__":  # python -m imgtrain.data.shards.convert SRC DST (imgtrain-shards checks LitData first)
    sys.exit(main())
