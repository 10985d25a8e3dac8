"""In-memory datasets (CIFAR, synthetic) a batch at a time against a sample at a time, in one process.

The same TensorImageDataset of 50,000 uint8 32-px images, batches of 256 through GuardedSamples and collate (what
one DataLoader worker runs): `batch_items` (one gather, CIFAR's padded crop and flip for the batch) against the
per-sample path (the v2 transform per image, under each sample's seed), interleaved rounds, medians and spreads.

    python benchmarks/batched_tensors.py [--rounds 7] [--batches 20]
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch
from torchvision.transforms import v2

from imgtrain.data.datasets import TensorImageDataset
from imgtrain.data.samples import GuardedSamples, collate

CIFAR_TRAIN = v2.Compose([v2.RandomCrop(32, padding=4), v2.RandomHorizontalFlip()])


class PerSample(GuardedSamples):
    """GuardedSamples without the batch path: each item as `__getitem__` gives it (the path before issue 22)."""

    def __getitems__(self, items):
        return [self[item] for item in items]


def images_per_second(samples: GuardedSamples, batches: int, batch: int, offset: int) -> float:
    started = time.perf_counter()
    for b in range(batches):
        items = [((offset + b * batch + i) % 50_000, 7919 * (b * batch + i)) for i in range(batch)]
        collate(samples.__getitems__(items))
    return batches * batch / (time.perf_counter() - started)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--batches", type=int, default=20)
    args = parser.parse_args()
    torch.set_num_threads(1)  # one worker's share
    images = torch.randint(0, 256, (50_000, 3, 32, 32), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    labels = np.arange(50_000) % 10
    for name, transform in (("CIFAR training (padded crop + flip)", CIFAR_TRAIN), ("synthetic (no transform)", None)):
        dataset = TensorImageDataset(images, labels, [str(i) for i in range(10)], transform)
        paths = {"per sample": PerSample(dataset), "per batch": GuardedSamples(dataset)}
        rates: dict[str, list[float]] = {path: [] for path in paths}
        for round_ in range(args.rounds):
            for path, samples in paths.items():
                rates[path].append(images_per_second(samples, args.batches, 256, round_ * 9973))
        cells = {p: (statistics.median(r), min(r), max(r)) for p, r in rates.items()}
        ratio = cells["per batch"][0] / cells["per sample"][0]
        shown = "; ".join(f"{p}: {m:,.0f} ({lo:,.0f}-{hi:,.0f}) img/s" for p, (m, lo, hi) in cells.items())
        print(f"{name}: {shown}; per batch / per sample {ratio:.1f}x")


if __name__ == "__main__":
    main()
