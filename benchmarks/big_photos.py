"""Big photos through the training loader: the full decode, scaled decoding (dataset.scaled_decode) and shards
packed at `imgtrain-shards --max-side 512`, for 6-MP and 12-MP photos and ImageNet-sized JPEGs, at the training
crop (rrc_flip, 224 px) and the validation resize, on one core (data.num_workers=0) and with 2 workers.

Each measurement builds the loader train.py builds (compose, validate, build_data: the same code path, in this
process), skips `--warmup` batches and times `--batches` more: images/s. Rounds interleave the methods of each
case (the order rotated every round), so the machine's drift reaches them alike; each row gives the median over
the rounds, the range, and the median of the per-round ratios to the full decode of the same round and case.

Files: benchmarks/photos.py's photo-like content at quality 90, `--distinct` files per set hard-linked to `--files`
names (the decode is the same work; the page cache holds them after the first round). The packed shards are
written once per set, with --max-side 512 at quality 90 (the converter's default).

    python benchmarks/big_photos.py --rounds 3 --json big_photos.json --markdown big_photos.md

`make bench` runs it as its `big-photos` section (`bench.py --only big-photos`), and judges the goals: photos at
least 1.3x the full decode's rate by scaled decoding alone and 10x packed, ImageNet-sized files at least 0.97x.
Without LitData (the `shards` extra) the packed rows are left out, and said so.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from hydra import compose, initialize_config_dir

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT / "src"))
import photos  # noqa: E402  benchmarks/photos.py

from imgtrain.config.validate import validate  # noqa: E402
from imgtrain.data.pipeline import build_data  # noqa: E402
from imgtrain.host import dist, optional  # noqa: E402
from imgtrain.train.cli import register  # noqa: E402

SETS = {"6mp": (3000, 2000), "12mp": (4000, 3000), "imagenet": (500, 375)}
METHODS = ("full", "scaled", "packed")
USES = ("train", "val")
MAX_SIDE = 512
# The goals, each a median ratio to the full decode: photos (6 and 12 MP) and ImageNet-sized files
GOALS = {"photos": {"scaled": 1.3, "packed": 10.0}, "imagenet": {"scaled": 0.97}}
QUICK = ["--sets", "6mp,imagenet", "--workers", "0", "--files", "8", "--imagenet-files", "8", "--distinct", "2"]
QUICK += ["--batch", "4", "--warmup", "1", "--batches", "1", "--min-seconds", "0", "--rounds", "1"]


def make_set(root: Path, name: str, files: int, distinct: int) -> Path:
    """root/name/{train,val}/c{0,1}/*.jpg: `distinct` rendered photos (in root/name-sources), linked to `files`
    names per split."""
    folder, done = root / name, root / f"{name}-sources" / "done"
    if done.exists():
        return folder
    rng = np.random.default_rng(len(name))
    width, height = SETS[name]
    sources = []
    for i in range(distinct):
        portrait = i % 4 == 3  # a quarter portrait, as photos.py draws them
        path = done.parent / f"{i}.jpg"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(photos.render(height, width, rng) if portrait else photos.render(width, height, rng))
        sources.append(path)
    for split in ("train", "val"):
        for i in range(files):
            target = folder / split / f"c{i % 2}" / f"{i}.jpg"
            target.parent.mkdir(parents=True, exist_ok=True)
            os.link(sources[i % distinct], target)
    done.write_text("")
    return folder


def pack(folder: Path) -> Path:
    """The set packed by imgtrain-shards at --max-side MAX_SIDE (once)."""
    packed = folder.parent / f"{folder.name}-max{MAX_SIDE}"
    if not (packed / "imgtrain-shards.json").exists():
        convert = importlib.import_module("imgtrain.data.shards.convert")  # LitData: the `shards` extra
        code = convert.main([str(folder), str(packed), "--max-side", str(MAX_SIDE), "--workers", "2"])
        assert code == 0, f"imgtrain-shards failed on {folder}"
    return packed


def measure(source: Path, method: str, use: str, workers: int, args: argparse.Namespace) -> dict:
    """Images/s of one loader: the training or validation split of `source` decoded by `method`."""
    dataset = ["dataset=shards"] if method == "packed" else ["dataset=imagefolder"]
    overrides = [
        *dataset,
        f"dataset.root={source}",
        f"dataset.scaled_decode={method != 'full'}",
        f"data.batch_size={args.batch}",
        f"data.val_batch_size={args.batch}",  # the same batches in both uses
        f"data.num_workers={workers}",
        f"output_dir={args.workdir / 'run'}",
    ]
    with initialize_config_dir(version_base="1.3", config_dir=str(ROOT / "conf")):
        settings = validate(compose("config", overrides=overrides))
    data = build_data(settings, dist.DistInfo(), torch.device("cpu"), torch.contiguous_format, args.workdir / "run")
    data.start_epoch(0, 0)
    try:
        batches = iter(data.train if use == "train" else data.val)
        for _ in range(max(args.warmup, 2 * workers)):  # the batches each worker's prefetch has ready at once
            next(batches)
        started, images, taken = time.perf_counter(), 0, 0
        # at least --batches, and at least --min-seconds while the split lasts: ImageNet-sized files go ~50x faster
        while taken < args.batches or time.perf_counter() - started < args.min_seconds:
            batch = next(batches, None)
            if batch is None:
                break
            images, taken = images + len(batch.labels), taken + 1
        seconds = time.perf_counter() - started
    finally:
        data.close()
    return {"images_per_sec": images / seconds, "images": images, "seconds": seconds}


def run(args: argparse.Namespace) -> list[dict]:
    torch.set_num_threads(1)  # one core per loader process: the main process with 0 workers, each worker with 2
    register()
    methods = METHODS if not optional.missing("litdata") else METHODS[:2]
    sources = {}
    for name in args.sets:
        folder = make_set(args.workdir, name, args.imagenet_files if name == "imagenet" else args.files, args.distinct)
        sources[name] = {"full": folder, "scaled": folder}
        sources[name] |= {"packed": pack(folder)} if "packed" in methods else {}
    results = []
    for round_ in range(args.rounds):
        for name in args.sets:
            for use in USES:
                for workers in args.workers:
                    turn = round_ % len(methods)
                    for method in methods[turn:] + methods[:turn]:
                        found = measure(sources[name][method], method, use, workers, args)
                        row = {"round": round_, "set": name, "use": use, "workers": workers, "method": method}
                        results.append({**row, **found})
                        print(json.dumps(results[-1]), flush=True)
    return results


def table(results: list[dict]) -> str:
    """One row per set, use, workers and method: median images/s (range), x the full decode (median; range)."""
    lines = [
        "| files, use | workers | decode | images/s (median; range) | x full decode (median; range) |",
        "| --- | ---: | --- | ---: | ---: |",
    ]
    cases = sorted({(r["set"], r["use"], r["workers"]) for r in results}, key=lambda c: (list(SETS).index(c[0]), c))
    for name, use, workers in cases:
        case = [r for r in results if (r["set"], r["use"], r["workers"]) == (name, use, workers)]
        full = {r["round"]: r["images_per_sec"] for r in case if r["method"] == "full"}
        for method in (m for m in METHODS if any(r["method"] == m for r in case)):
            rates = [r for r in case if r["method"] == method]
            values = [r["images_per_sec"] for r in rates]
            ratios = [r["images_per_sec"] / full[r["round"]] for r in rates if r["round"] in full]
            lines.append(
                f"| {name} {use} | {workers} | {method} | {statistics.median(values):,.1f} "
                f"({min(values):,.1f}-{max(values):,.1f}) | {statistics.median(ratios):.2f}x "
                f"({min(ratios):.2f}-{max(ratios):.2f}) |"
            )
    return "\n".join(lines)


def goals(results: list[dict]) -> list[str]:
    """Each goal judged by its worst case (the lowest median of the per-round ratios): met; not separated from
    the goal (below it, but some round of that case reaches it); or not met (every round below)."""
    lines = []
    for group, wanted in GOALS.items():
        names = ("6mp", "12mp") if group == "photos" else ("imagenet",)
        for method, least in wanted.items():
            cases = []  # each case's per-round ratios
            for case in sorted({(r["set"], r["use"], r["workers"]) for r in results if r["set"] in names}):
                rows = [r for r in results if (r["set"], r["use"], r["workers"]) == case]
                full = {r["round"]: r["images_per_sec"] for r in rows if r["method"] == "full"}
                found = [r["images_per_sec"] / full[r["round"]] for r in rows if r["method"] == method]
                cases += [found] if found else []
            if not cases:
                lines.append(f"- {group}, {method}: not measured")
                continue
            worst = min(cases, key=statistics.median)
            verdict = "met" if statistics.median(worst) >= least else "not met"
            verdict = "not separated from the goal" if verdict == "not met" and max(worst) >= least else verdict
            medians = [statistics.median(found) for found in cases]
            lines.append(
                f"- {group}, {method} >= {least}x the full decode: {verdict} (case medians {min(medians):.2f}-"
                f"{max(medians):.2f}x over {len(cases)} cases; the lowest case's rounds {min(worst):.2f}-"
                f"{max(worst):.2f}x)"
            )
    return lines


def section(workdir: Path, quick: bool, rounds: int) -> dict:
    """bench.py's `big-photos` section: the quick smoke test's tiny sets, or the full measurement."""
    args = _parser().parse_args(QUICK if quick else ["--rounds", str(rounds)])
    args.workdir = workdir / "big-photos"
    args.workdir.mkdir(parents=True, exist_ok=True)
    results = run(args)
    no_litdata = optional.missing("litdata")
    note = "packed rows not measured: LitData (the shards extra) is not installed" if no_litdata else ""
    return {"rows": results, "table": table(results), "goals": goals(results), "note": note, "sets": args.sets}


def render(report: dict) -> list[str]:
    """The section's markdown, when the report holds it."""
    if "big_photos" not in report:
        return []
    result = report["big_photos"]
    lines = ["", "### Big photos: full decode, scaled decoding, shards at --max-side 512 (CPU)", ""]
    lines += [result["table"], "", *result["goals"]]
    return [*lines, *([result["note"]] if result["note"] else []), ""]


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sets", type=lambda s: s.split(","), default=list(SETS), help="6mp,12mp,imagenet")
    parser.add_argument("--workers", type=lambda s: [int(v) for v in s.split(",")], default=[0, 2])
    parser.add_argument("--files", type=int, default=96, help="file names per split of a photo set")
    parser.add_argument("--imagenet-files", type=int, default=1536, help="of the ImageNet-sized set: 2 s at 750/s")
    parser.add_argument("--distinct", type=int, default=16, help="distinct photos per set")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=2, help="batches skipped (at least 2 per worker)")
    parser.add_argument("--batches", type=int, default=8, help="batches timed, at least")
    parser.add_argument("--min-seconds", type=float, default=2.0, help="seconds timed, at least, while files last")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--workdir", type=Path, default=None, help="where the sets are made (kept between runs)")
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--markdown", type=Path, default=None)
    return parser


def main() -> None:
    args = _parser().parse_args()
    args.workdir = args.workdir or Path(tempfile.gettempdir()) / "imgtrain-big-photos"
    args.workdir.mkdir(parents=True, exist_ok=True)
    results = run(args)
    text = table(results)
    print(text)
    if args.json:
        args.json.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "rows": results}))
    if args.markdown:
        args.markdown.write_text(text + "\n")


if __name__ == "__main__":
    main()
