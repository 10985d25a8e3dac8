"""Two sections of the harness that time kernels in this process, on one thread (no train.py run):

  decode-cpu      CPU JPEG decode: torchvision.io.decode_image (the old CPU path) against imgtrain's decode_bytes
                  (TorchCodec's decode_image), on JPEGs of 500x375 at quality 90 made in memory with PIL (a
                  random gradient plus noise, so the entropy coder has work); images/s, and how far apart the
                  two decoders' pixels are (mean |difference| in levels);
  resize-kernels  the crop-and-resize kernels data/batched.py chooses between, in ms per image: torchvision's v2
                  RandomResizedCrop and flip per sample, the uint8 antialiased resize per image on the crop
                  (`resized_crop`), and one `roi_align` call for the whole batch in float; a batch of 64 crops
                  of 80% of the side per case, except the 500x375 JPEG-sized one (16 images, a ResNet crop).

Each figure is the median and min-max over `rounds` interleaved rounds (the order alternating from round to
round, so a drift of the machine's speed falls on every variant).
"""

from __future__ import annotations

import io
import statistics
import time
from collections.abc import Callable
from functools import partial

import numpy as np
import torch
import torchvision
import torchvision.transforms.v2.functional as F
from PIL import Image
from torchvision.io import ImageReadMode
from torchvision.io import decode_image as torchvision_decode
from torchvision.ops import roi_align
from torchvision.transforms import v2

from imgtrain.data.decoders import cpu_decoder, decode_bytes

RESIZE_CASES = [(32, 32, 64), (48, 48, 64), (64, 64, 64), (96, 64, 64), (128, 112, 64), ((375, 500), 224, 16)]
RESIZE_WAYS = ("v2 per sample", "uint8 resize per image", "roi_align per batch")


def _one_thread(measure: Callable[[], dict]) -> dict:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return {"torch_threads": 1, **measure()}
    finally:
        torch.set_num_threads(threads)


def _spread(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "runs": values}


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


def _rate(decode: Callable[[torch.Tensor], torch.Tensor], files: list[torch.Tensor]) -> float:
    started = time.perf_counter()
    for data in files:
        decode(data)
    return len(files) / (time.perf_counter() - started)


def decode_cpu(images: int, rounds: int, size: tuple[int, int] = (500, 375)) -> dict:
    """Images/s of each CPU decoder over the same in-memory JPEGs, interleaved rounds, one thread."""

    def measure() -> dict:
        files = make_jpegs(images, *size)
        rgb = partial(torchvision_decode, mode=ImageReadMode.RGB)
        decoders = {
            f"torchvision {torchvision.__version__} io.decode_image": rgb,
            # TorchCodec, imported here (when this section runs): the GPU box has none, and bench.py imports this file
            f"{cpu_decoder().name} (imgtrain decode_bytes)": lambda d: decode_bytes(d, "bench"),
        }
        first, second = list(decoders)
        diffs = [float((decoders[first](d).int() - decoders[second](d).int()).abs().float().mean()) for d in files]
        rates: dict[str, list[float]] = {name: [] for name in decoders}
        for round_ in range(rounds):  # the pass above warmed both up
            for name in list(decoders) if round_ % 2 == 0 else reversed(list(decoders)):
                rates[name].append(_rate(decoders[name], files))
        return {
            "images": images,
            "size": list(size),
            "kib_per_image": sum(len(d) for d in files) / len(files) / 1024,
            "rounds": rounds,
            "decoders": {name: _spread(values) for name, values in rates.items()},
            "pixel_difference_mean": float(np.mean(diffs)),
            "pixel_difference_max": max(diffs),
        }

    return _one_thread(measure)


def _per_image_ms(call: Callable[[], object], images: int, repeats: int) -> float:
    call()
    started = time.perf_counter()
    for _ in range(repeats):
        call()
    return (time.perf_counter() - started) / repeats / images * 1000.0


def _resize_ways(source: int | tuple[int, int], size: int, count: int) -> dict[str, Callable[[], object]]:
    height, width = (source, source) if isinstance(source, int) else source
    generator = torch.Generator().manual_seed(0)
    images = torch.randint(0, 256, (count, 3, height, width), dtype=torch.uint8, generator=generator)
    crop_h, crop_w = int(height * 0.8), int(width * 0.8)
    transform = v2.Compose([v2.RandomResizedCrop(size, antialias=True), v2.RandomHorizontalFlip()])
    rois = torch.tensor([[i, 2, 3, 2 + crop_w, 3 + crop_h] for i in range(count)], dtype=torch.float32)
    return dict(
        zip(
            RESIZE_WAYS,
            (
                lambda: [transform(image) for image in images],
                lambda: [F.resized_crop(image, 3, 2, crop_h, crop_w, [size, size], antialias=True) for image in images],
                lambda: roi_align(images.float(), rois, (size, size), sampling_ratio=-1, aligned=True).round_().byte(),
            ),
            strict=True,
        )
    )


def resize_kernels(rounds: int, repeats: int, cases: list | None = None) -> dict:
    """Ms per image of each way to crop and resize, per case (source -> output), `repeats` calls per figure."""

    def measure() -> dict:
        rows = []
        for source, size, count in cases or RESIZE_CASES:
            ways = _resize_ways(source, size, count)
            ms: dict[str, list[float]] = {name: [] for name in ways}
            for _ in range(rounds):
                for name, call in ways.items():
                    ms[name].append(_per_image_ms(call, count, repeats))
            shown = "x".join(str(s) for s in source) if isinstance(source, tuple) else f"{source}x{source}"
            rows.append({"case": f"{shown} -> {size}", "images": count, **{k: _spread(v) for k, v in ms.items()}})
        return {"rounds": rounds, "repeats": repeats, "rows": rows}

    return _one_thread(measure)


def render(report: dict) -> list[str]:
    """The markdown of whichever of the two sections the report holds."""
    lines: list[str] = []
    if "decode_cpu" in report:
        result = report["decode_cpu"]
        width, height = result["size"]
        lines += ["", "### CPU JPEG decode (one thread)", ""]
        lines.append(f"{result['images']} JPEGs {width}x{height}, quality 90, {result['kib_per_image']:.0f} KiB each; "
                     f"interleaved rounds: {result['rounds']}.")  # fmt: skip
        lines += ["", "| decoder | images/s, median (min-max) |", "| --- | ---: |"]
        for name, s in result["decoders"].items():
            lines.append(f"| {name} | {s['median']:.0f} ({s['min']:.0f}-{s['max']:.0f}) |")
        lines += ["", f"Pixels: mean |difference| {result['pixel_difference_mean']:.3f} levels "
                      f"(the largest of one image {result['pixel_difference_max']:.3f})."]  # fmt: skip
    if "resize_kernels" in report:
        result = report["resize_kernels"]
        lines += ["", "### Crop-and-resize kernels (one thread), ms per image: median (min-max)", ""]
        lines += ["| source -> output | " + " | ".join(RESIZE_WAYS) + " |", "| --- |" + " ---: |" * len(RESIZE_WAYS)]
        for row in result["rows"]:
            cells = [f"{row[w]['median']:.4f} ({row[w]['min']:.4f}-{row[w]['max']:.4f})" for w in RESIZE_WAYS]
            lines.append(f"| {row['case']} | " + " | ".join(cells) + " |")
    return lines
