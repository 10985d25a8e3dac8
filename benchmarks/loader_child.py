"""One measurement of bench.py's augment-loaders section, in a process of its own (benchmarks/recipes.py starts it):

    python benchmarks/loader_child.py loader --side ours|timm --root FOLDER --policy POLICY --workers N ...

prints one JSON line: images/s over the measured batches, and the stage ms per image. `ours` builds the training
loader train.py builds (hydra compose, validate, pipeline.build_data); `timm` runs with timm 1.0.28 on its
PYTHONPATH and imports nothing of imgtrain's (imgtrain's models import the venv's timm), so this file imports only
torch, NumPy and Pillow at the top.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from PIL import Image  # timm decodes with PIL

ROOT = Path(__file__).resolve().parents[1]
POLICIES = ("rrc_flip", "trivialaugment", "randaugment")
# timm 1.0.28's auto_augment string for each policy. It has no TrivialAugment (timm/data/auto_augment.py knows
# 'rand', 'augmix' and AutoAugment's 'original'/'v0' policies): the nearest it has is TrivialAugment's recipe in
# RandAugment's terms: one op per image, always applied (p1), magnitude uniform in 0..10 (mstd > 100), with its own
# ops and ranges (not torchvision's "wide" ones). `inc1`, the "increasing" op set: in the default set a magnitude
# under 2.5 makes Posterize keep 0 bits, which Pillow 13 refuses (ValueError), so the default set cannot sample
# magnitudes uniformly. timm's 'rand-m9-n2' applies each of its 2 ops with p=0.5; torchvision's RandAugment both.
TIMM_POLICY = {"rrc_flip": None, "trivialaugment": "rand-m10-n1-mstd101-inc1-p1", "randaugment": "rand-m9-n2"}
STAGES = ("read", "decode", "augment", "collate", "busy")


def _timed(batches, warmup: int, count: int, size_of, times_of) -> dict:
    """Images/s over `count` batches after `warmup` (the workers' first batches, which arrive together), and the
    stage seconds the batches carry, in ms per image."""
    for _ in range(warmup):
        next(batches)
    images, sums = 0, dict.fromkeys(STAGES, 0.0)
    started = time.perf_counter()
    for _ in range(count):
        batch = next(batches)
        images += size_of(batch)
        times = times_of(batch)
        for stage in STAGES if times else ():
            sums[stage] += getattr(times, stage)
    seconds = time.perf_counter() - started
    result = {"images_per_sec": images / seconds, "images": images, "seconds": seconds}
    result["load_average_1min"] = os.getloadavg()[0]  # the machine's other work, if any, at the end
    if any(sums.values()):
        result["stage_ms"] = {stage: 1000 * value / images for stage, value in sums.items()}
    return result


def _crop_scale(transform) -> list[float] | None:
    """The scale of the first RandomResizedCrop in `transform` (searched through `.transforms` lists)."""
    if hasattr(transform, "scale") and "ResizedCrop" in type(transform).__name__:
        return [float(v) for v in transform.scale]
    for step in getattr(transform, "transforms", None) or []:
        found = _crop_scale(step)
        if found:
            return found
    return None


def ours_loader(args: argparse.Namespace) -> dict:
    """The training loader train.py builds for dataset=imagefolder, dataset.augment=<policy>, on the CPU: its
    batches are uint8, normalised later on the device (data/feed.py)."""
    # Imported here, in this child only: the timm child must load nothing of imgtrain's (its models import timm)
    from hydra import compose, initialize_config_dir

    from imgtrain.config.validate import validate
    from imgtrain.data.pipeline import build_data
    from imgtrain.host import dist
    from imgtrain.train.cli import register

    out = Path(tempfile.mkdtemp(prefix="imgtrain-loader-"))
    overrides = [
        "dataset=imagefolder",
        f"dataset.root={args.root}",
        f"dataset.image_size={args.size}",
        f"dataset.augment={args.policy}",
        f"data.batch_size={args.batch}",
        f"data.num_workers={args.workers}",
        f"output_dir={out}",
    ]
    register()
    with initialize_config_dir(version_base="1.3", config_dir=str(ROOT / "conf")):
        settings = validate(compose("config", overrides=overrides))
    data = build_data(settings, dist.DistInfo(), torch.device("cpu"), torch.contiguous_format, out)
    data.start_epoch(0, 0)
    try:
        result = _timed(iter(data.train), args.warmup, args.batches, lambda b: len(b.labels), lambda b: b.times)
    finally:
        data.close()
        shutil.rmtree(out, ignore_errors=True)  # the run's loader_args.json and log: nothing this child reports
    transform = data.bundle.train.transform
    return {**result, "transform": " ".join(repr(transform).split()), "crop_scale": _crop_scale(transform)}


def timm_loader(args: argparse.Namespace) -> dict:
    """timm's own loader for the same policy, as its train.py builds it by default: create_dataset, then
    create_loader with the prefetcher, so its workers hand over uint8 batches (MaybePILToTensor, fast_collate) as
    ours do, and normalisation is left to the device. Timed: the DataLoader under timm's PrefetchLoader, whose
    normalisation on this CPU would be main-process work that ours does not have in its loader either."""
    # Imported here: this child's PYTHONPATH holds timm 1.0.28 (the parent's process may hold the venv's)
    import timm
    from timm.data import create_dataset, create_loader

    random.seed(0), np.random.seed(0), torch.manual_seed(0)
    dataset = create_dataset("", root=args.root, split="train", is_training=True)
    loader = create_loader(
        dataset,
        input_size=(3, args.size, args.size),
        batch_size=args.batch,
        is_training=True,
        scale=tuple(args.scale),
        color_jitter=None,  # timm's default 0.4 jitters when no auto_augment is given; ours has no jitter
        auto_augment=TIMM_POLICY[args.policy],
        interpolation="bilinear",
        num_workers=args.workers,
        device=torch.device("cpu"),
        use_prefetcher=True,
    )
    transform = dataset.transform
    result = _timed(iter(loader.loader), args.warmup, args.batches, lambda b: len(b[1]), lambda b: None)
    result |= {"timm_version": timm.__version__, "transform": " ".join(repr(transform).split())}
    if args.profile:
        result["profile_ms"] = _timm_profile(dataset, transform, args.profile)
    return result


def _timm_profile(dataset, transform, count: int) -> dict[str, float]:
    """timm's per-image stages in this process on one thread (as in a DataLoader worker), ms per image: PIL's
    open and decode, then each step of its transform; after four images untimed."""
    torch.set_num_threads(1)
    paths = [path for path, _ in dataset.reader.samples]
    for path in paths[:4]:
        _timm_steps(path, transform, {})
    ms: dict[str, float] = {}
    for index in np.linspace(0, len(paths) - 1, count).astype(int):
        _timm_steps(paths[index], transform, ms)
    return {name: 1000 * seconds / count for name, seconds in ms.items()}


def _timm_steps(path: str, transform, ms: dict[str, float]) -> None:
    """One image through timm's stages, each one's seconds added to `ms`."""
    started = time.perf_counter()
    image = Image.open(path).convert("RGB")
    ms["read+decode (PIL)"] = ms.get("read+decode (PIL)", 0.0) + time.perf_counter() - started
    for step in transform.transforms:
        started = time.perf_counter()
        image = step(image)
        ms[type(step).__name__] = ms.get(type(step).__name__, 0.0) + time.perf_counter() - started


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="One measurement of bench.py's augment-loaders section")
    parser.add_argument("what", choices=["loader"])
    parser.add_argument("--side", choices=["ours", "timm"], required=True)
    parser.add_argument("--root", required=True, help="the JPEG folder (train/<class>/*.jpg)")
    parser.add_argument("--policy", choices=POLICIES, required=True)
    parser.add_argument("--workers", type=int, default=1)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--size", type=int, default=224, help="the crop's side, px")
    parser.add_argument("--warmup", type=int, default=3, help="batches before the clock starts")
    parser.add_argument("--batches", type=int, default=16, help="batches measured")
    parser.add_argument("--scale", type=float, nargs=2, default=(0.08, 1.0), help="timm's crop scale")
    parser.add_argument("--profile", type=int, default=0, help="timm: images to time step by step afterwards")
    args = parser.parse_args(argv)
    print(json.dumps(ours_loader(args) if args.side == "ours" else timm_loader(args)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
