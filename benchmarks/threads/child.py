"""One measurement of measure.py, in a process of its own (so import cost and memory do not leak between engines):

    python benchmarks/threads/child.py --engine dataloader|torchdata|spdl --dataset photos|shapes --root DIR
        --policy rrc_flip|trivialaugment --workers N [--batch 64 --epochs 3 --skip K --images M]

builds the training Dataset with the project's own builder (datasets.build_imagefolder or build_shapes, with the
schema's defaults, as hydra's instantiate calls it), the plan train.py would make (loader.plan_loader), the engine's
loader over it (engines.py), then runs `--epochs` epochs and prints one JSON line: the time to the first batch
(from the loader's construction: worker processes or threads start inside it), each later epoch's stall (from its
`iter()` to its first batch), images/s over the steady part of every epoch (from the arrival of batch `skip` to
the last one's), and a digest of the first batches (equal across engines when the augmentation is reproducible).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from engines import ENGINES, build, engine_module, plan_of  # noqa: E402

from imgtrain.config.datasets import ImageFolderConfig, ShapesConfig  # noqa: E402
from imgtrain.data import datasets  # noqa: E402

DIGESTED = 2  # batches of the first epoch whose pixels are digested (inside the skipped start: not timed)
SHAPES_VAL = 64  # validation images generated beside the training set (never read here)


def dataset_of(kind: str, root: str, policy: str, images: int) -> Any:
    """The training split as the builder of dataset=imagefolder (`root`: a folder with train/ and val/) or
    dataset=shapes (`root`: where the shapes are generated, `images` of them) makes it, other keys at the
    schema's defaults (224-px crops for the folder, 32 px for shapes)."""
    schema = ImageFolderConfig(root=root) if kind == "photos" else ShapesConfig(root=root, num_train=images)
    keys = {f.name: getattr(schema, f.name) for f in dataclasses.fields(schema) if f.name != "_target_"}
    keys["augment"] = policy
    if kind == "photos":
        return datasets.build_imagefolder(**keys).train
    return datasets.build_shapes(**(keys | {"num_val": SHAPES_VAL})).train


def digest(batch: Any) -> int:
    """An order-sensitive checksum of a batch's pixels and labels (no copy of the batch)."""
    images = batch.images.reshape(len(batch.labels), -1)
    per_image = images.sum(dim=1, dtype=torch.int64)
    weights = torch.arange(1, len(per_image) + 1, dtype=torch.int64)
    return int((per_image * weights).sum()) ^ int((batch.labels * weights).sum())


def run_epoch(batches: Any, started: float, skip: int, digests: list[int] | None) -> dict[str, Any]:
    """Consume one epoch: when its first batch came (seconds after `started`), and its steady part's images and
    seconds (after batch `skip` arrived)."""
    arrivals, sizes = [], []
    for batch in batches:
        arrivals.append(time.perf_counter())
        sizes.append(len(batch.labels))
        if digests is not None and len(digests) < DIGESTED:
            digests.append(digest(batch))
    if not arrivals:
        raise RuntimeError("an epoch without a batch: more images, or a smaller --batch")
    steady = len(arrivals) > skip + 1
    return {
        "first_batch_s": arrivals[0] - started,
        "batches": len(arrivals),
        "images": sum(sizes),
        "steady_images": sum(sizes[skip + 1 :]) if steady else 0,
        "steady_s": arrivals[-1] - arrivals[skip] if steady else 0.0,
    }


def measure(args: argparse.Namespace) -> dict[str, Any]:
    torch.set_num_threads(1)  # the consumer's own kernels (none to speak of): 2 cores, no oversubscription
    started = time.perf_counter()
    dataset = dataset_of(args.dataset, args.root, args.policy, args.images)
    dataset_s = time.perf_counter() - started
    plan = plan_of(args.batch, args.workers)
    skip = 2 * args.workers + 1 if args.skip < 0 else args.skip
    digests: list[int] = []
    imported = time.perf_counter()
    engine_module(args.engine)
    built = time.perf_counter()
    loader = build(args.engine, dataset, plan)
    epochs = []
    try:
        for epoch in range(args.epochs):
            asked = built if epoch == 0 else time.perf_counter()
            epochs.append(run_epoch(loader.epoch(epoch), asked, skip, digests if epoch == 0 else None))
    finally:
        loader.close()
    steady_images = sum(e["steady_images"] for e in epochs)
    steady_s = sum(e["steady_s"] for e in epochs)
    return {
        "engine": args.engine,
        "dataset": args.dataset,
        "policy": args.policy,
        "workers": args.workers,
        "batch": args.batch,
        "train_images": len(dataset),
        "skip": skip,
        # from the driver's spawn (perf_counter is CLOCK_MONOTONIC: one clock for every process) to the loader's
        # construction: interpreter start, imports, the dataset's listing
        "startup_s": built - args.spawned if args.spawned else None,
        "dataset_s": dataset_s,
        "engine_import_s": built - imported,
        "images_per_sec": steady_images / steady_s if steady_s else None,
        "first_batch_s": epochs[0]["first_batch_s"],
        "stall_s": [e["first_batch_s"] for e in epochs[1:]],
        "epochs": epochs,
        "digest": digests,
        "in_flight": loader.bounds(),
        "torch_threads_main": torch.get_num_threads(),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="One loader measurement (benchmarks/threads/measure.py runs it)")
    parser.add_argument("--engine", choices=ENGINES, required=True)
    parser.add_argument("--dataset", choices=["photos", "shapes"], required=True)
    parser.add_argument("--root", required=True, help="photos: the folder (train/, val/); shapes: where they live")
    parser.add_argument("--policy", default="rrc_flip", help="dataset.augment")
    parser.add_argument("--workers", type=int, default=1, help="worker processes or threads")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--skip", type=int, default=-1, help="batches before the steady part (-1: 2 x workers + 1)")
    parser.add_argument("--images", type=int, default=5000, help="shapes: training images")
    parser.add_argument("--spawned", type=float, default=0.0, help="the driver's time.perf_counter() at the spawn")
    print(json.dumps(measure(parser.parse_args(argv))), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
