"""CPU JPEG decode throughput: torchvision.io.decode_image (the old CPU path) against imgtrain's decode_bytes
(TorchCodec's decode_image), on one thread.

    python benchmarks/decode_cpu.py                 # 400 JPEGs of 500x375, quality 90; 5 interleaved rounds

The JPEGs (gradients plus noise, so the entropy coder has work) are made in memory with PIL. Each round decodes
every image once with each decoder, the order of the two alternating from round to round, so a drift of the
machine's speed falls on both. Prints each decoder's median and min-max images/s over the rounds, and how far
apart their pixels are (mean |difference| in levels).
"""

from __future__ import annotations

import argparse
import datetime
import io
import statistics
import time
from collections.abc import Callable

import numpy as np
import torch
import torchcodec
import torchvision
from PIL import Image
from torchvision.io import ImageReadMode
from torchvision.io import decode_image as torchvision_decode

from imgtrain.data.decoders import decode_bytes
from imgtrain.metrics.environment import cpu_model


def make_jpegs(count: int, width: int, height: int, seed: int = 0) -> list[torch.Tensor]:
    """`count` JPEG files (quality 90) as 1-d uint8 tensors: a random gradient per image plus noise."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width].astype(np.float32)
    files = []
    for _ in range(count):
        slopes = rng.uniform(-0.6, 0.6, size=(2, 3))
        pixels = 128 + x[..., None] * slopes[0] + y[..., None] * slopes[1] - 80 + rng.normal(0, 20, (height, width, 3))
        buffer = io.BytesIO()
        Image.fromarray(np.clip(pixels, 0, 255).astype(np.uint8)).save(buffer, "JPEG", quality=90)
        files.append(torch.frombuffer(bytearray(buffer.getvalue()), dtype=torch.uint8))
    return files


def rate(decode: Callable[[torch.Tensor], torch.Tensor], files: list[torch.Tensor]) -> float:
    """Images/s for one pass over `files`."""
    started = time.perf_counter()
    for data in files:
        decode(data)
    return len(files) / (time.perf_counter() - started)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--images", type=int, default=400)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--size", type=int, nargs=2, default=(500, 375), metavar=("WIDTH", "HEIGHT"))
    args = parser.parse_args()
    torch.set_num_threads(1)
    files = make_jpegs(args.images, *args.size)
    decoders = {
        f"torchvision {torchvision.__version__} io.decode_image": lambda d: torchvision_decode(d, ImageReadMode.RGB),
        f"torchcodec {torchcodec.__version__} (imgtrain decode_bytes)": lambda d: decode_bytes(d, "bench"),
    }
    names = list(decoders)
    differences = [(decoders[names[0]](d).int() - decoders[names[1]](d).int()).abs().float().mean() for d in files]
    rates: dict[str, list[float]] = {name: [] for name in names}
    for round_ in range(args.rounds):  # the first pass above warmed both up
        for name in names if round_ % 2 == 0 else reversed(names):
            rates[name].append(rate(decoders[name], files))
    kb = sum(len(d) for d in files) / len(files) / 1024
    print(f"{datetime.datetime.now():%Y-%m-%d %H:%M} | {cpu_model()} | torch threads 1")
    print(f"{args.images} JPEGs {args.size[0]}x{args.size[1]}, quality 90, {kb:.0f} KiB each; {args.rounds} rounds")
    for name, values in rates.items():
        print(f"{name}: median {statistics.median(values):.0f} images/s, min-max {min(values):.0f}-{max(values):.0f}")
    worst = max(differences)
    print(f"pixels: mean |difference| {float(np.mean(differences)):.3f} levels (the largest of one image {worst:.3f})")


if __name__ == "__main__":
    main()
