"""The crop-and-resize kernels data/batched.py chooses between, on one thread, per image:

    python benchmarks/resize_kernels.py

For each case (source size -> output size, a batch of 64 crops of 80% of the side, except the 500x375 JPEG-sized
case with a ResNet-style crop), three ways to do RandomResizedCrop's work: torchvision's v2 transform per sample
(crop, resize and flip, the per-sample path before issue 22), torchvision's uint8 antialiased resize called per
image on the crop (`resized_crop`), and one `torchvision.ops.roi_align` call for the whole batch in float. The
three run interleaved, `--rounds` times; each figure is the median and min-max over the rounds, in ms per image.
"""

from __future__ import annotations

import argparse
import datetime
import statistics
import time
from collections.abc import Callable

import torch
import torchvision.transforms.v2.functional as F
from torchvision.ops import roi_align
from torchvision.transforms import v2

CASES = [(32, 32, 64), (48, 48, 64), (64, 64, 64), (96, 64, 64), (128, 112, 64), ((375, 500), 224, 16)]


def _per_image_ms(call: Callable[[], object], images: int, repeats: int) -> float:
    call()
    started = time.perf_counter()
    for _ in range(repeats):
        call()
    return (time.perf_counter() - started) / repeats / images * 1000.0


def measure(source: int | tuple[int, int], size: int, count: int, repeats: int) -> dict[str, float]:
    height, width = (source, source) if isinstance(source, int) else source
    images = torch.randint(
        0, 256, (count, 3, height, width), dtype=torch.uint8, generator=torch.Generator().manual_seed(0)
    )
    crop_h, crop_w = int(height * 0.8), int(width * 0.8)
    transform = v2.Compose([v2.RandomResizedCrop(size, antialias=True), v2.RandomHorizontalFlip()])
    rois = torch.tensor([[i, 2, 3, 2 + crop_w, 3 + crop_h] for i in range(count)], dtype=torch.float32)
    ways = {
        "v2 per sample": lambda: [transform(image) for image in images],
        "uint8 resize per image": lambda: [
            F.resized_crop(image, 3, 2, crop_h, crop_w, [size, size], antialias=True) for image in images
        ],
        "roi_align per batch": lambda: (
            roi_align(images.float(), rois, (size, size), sampling_ratio=-1, aligned=True).round_().to(torch.uint8)
        ),
    }
    return {name: _per_image_ms(call, count, repeats) for name, call in ways.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=10, help="calls per figure")
    args = parser.parse_args()
    torch.set_num_threads(1)
    print(f"{datetime.datetime.now():%Y-%m-%d %H:%M}, torch {torch.__version__}, one thread")
    print("| source -> output | v2 per sample | uint8 resize per image | roi_align per batch |")
    print("| --- | ---: | ---: | ---: |")
    for source, size, count in CASES:
        rounds = [measure(source, size, count, args.repeats) for _ in range(args.rounds)]
        cells = []
        for name in rounds[0]:
            values = [r[name] for r in rounds]
            cells.append(f"{statistics.median(values):.4f} ({min(values):.4f}-{max(values):.4f})")
        shown = "x".join(str(s) for s in source) if isinstance(source, tuple) else f"{source}x{source}"
        print(f"| {shown} -> {size} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
