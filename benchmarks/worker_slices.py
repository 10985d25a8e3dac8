"""Whole batches against slices of a batch per worker (data.worker_batch_size), on a folder with a few 12-MP photos
among ImageNet-sized files: the loader's images/s, the settings interleaved in each round, medians and spreads.

The folder is benchmarks/photos.py's distribution (3% of the files 12-MP photos), at full size. Each measurement
builds the training loader as train.py does (build_data on the CPU), lets every worker's prefetch fill, then takes
batches through the feed (the join included) for at least --min-seconds. The ratio that matters is slices over
whole batches in the same round.

    python benchmarks/worker_slices.py [--files 1536] [--rounds 3] [--workers 2] [--batch 64] [--slice 16]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
from hydra import compose, initialize_config_dir

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "benchmarks"))
import photos  # noqa: E402  (benchmarks/photos.py)

from imgtrain.config.validate import validate  # noqa: E402
from imgtrain.data.pipeline import build_data  # noqa: E402
from imgtrain.host import dist  # noqa: E402
from imgtrain.train.cli import register  # noqa: E402


def measure(folder: Path, worker_batch: int, scaled: bool, args: argparse.Namespace) -> dict:
    """Images/s of the training loader with `worker_batch` samples per worker task."""
    overrides = [
        "dataset=imagefolder",
        f"dataset.root={folder}",
        f"dataset.scaled_decode={scaled}",
        f"data.batch_size={args.batch}",
        f"data.num_workers={args.workers}",
        f"data.worker_batch_size={worker_batch}",
        f"output_dir={args.workdir / 'run'}",
    ]
    with initialize_config_dir(version_base="1.3", config_dir=str(ROOT / "conf")):
        settings = validate(compose("config", overrides=overrides))
    data = build_data(settings, dist.DistInfo(), torch.device("cpu"), torch.contiguous_format, args.workdir / "run")
    images, seconds, epoch = 0, 0.0, 0
    try:
        while seconds < args.min_seconds:
            data.start_epoch(epoch, 0)
            batches = iter(data.train)
            if epoch == 0:  # the batches each worker's prefetch had ready at once are not the steady rate
                for _ in range(2):
                    next(batches)
            started = time.perf_counter()
            for batch in batches:
                data.feed.to_model(batch)
                images += len(batch.labels)
            seconds += time.perf_counter() - started
            epoch += 1
    finally:
        data.close()
    return {"images_per_sec": images / seconds, "images": images, "seconds": round(seconds, 2)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--files", type=int, default=1536)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--slice", type=int, default=16)
    parser.add_argument("--min-seconds", type=float, default=8.0)
    parser.add_argument("--scaled", choices=("true", "false", "both"), default="both")
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/imgtrain-worker-slices"))
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    torch.set_num_threads(1)
    register()
    folder = photos.ensure_folder(args.workdir / "photos", (args.files, 16), scale=1.0, processes=2)
    print(f"folder: {photos.summary(photos.describe(folder))}", flush=True)
    scaled = {"true": [True], "false": [False], "both": [False, True]}[args.scaled]
    rows: dict[str, list[float]] = {}
    for round_ in range(args.rounds):
        for decode in scaled:
            for worker_batch in (args.batch, args.slice):  # whole batches, then slices, in every round
                result = measure(folder, worker_batch, decode, args)
                key = f"scaled_decode={str(decode).lower()} worker_batch_size={worker_batch}"
                rows.setdefault(key, []).append(result["images_per_sec"])
                print(f"round {round_ + 1} {key}: {result}", flush=True)
    report = {"rows": rows, "ratios": {}}
    for decode in scaled:
        whole = rows[f"scaled_decode={str(decode).lower()} worker_batch_size={args.batch}"]
        sliced = rows[f"scaled_decode={str(decode).lower()} worker_batch_size={args.slice}"]
        ratios = [s / w for s, w in zip(sliced, whole, strict=True)]
        report["ratios"][f"scaled_decode={str(decode).lower()}"] = ratios
        print(
            f"scaled_decode={str(decode).lower()}: whole {statistics.median(whole):.1f} img/s, slices of {args.slice} "
            f"{statistics.median(sliced):.1f}; slices / whole per round: median {statistics.median(ratios):.2f}x "
            f"({min(ratios):.2f}-{max(ratios):.2f})",
            flush=True,
        )
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
