"""JPEG decoding at reduced scale, by binding, on one core: what libjpeg-turbo's 1/2, 1/4 and 1/8 scaling (in the
DCT domain) gains over the full decode the template does today, for photos and for ImageNet-like files.

Each decoder decodes the same files in every round; rounds interleave the decoders (the machine's drift reaches
all of them alike), and each row gives the median images/s over the rounds, the range, and the median of the
per-round ratios to the full decode of the same round. Decoders:

- `torchcodec` (the template's CPU decoder, data/decoders.py) and `PIL`: the full image;
- `PIL draft`: `Image.draft("RGB", size)`, which asks libjpeg-turbo for the smallest scale still at least `size`;
- `simplejpeg`: `decode_jpeg(min_width=..., min_height=...)`, the same scaling through its own libjpeg-turbo
  (skipped, and said, where simplejpeg is not installed: `pip install simplejpeg`).

The scale each file may be decoded at is what its use needs: `val` the validation resize (shorter side 256, then a
224 centre crop: conf's defaults), `rrc` RandomResizedCrop's box at 224 (torchvision's draws: scale 0.08-1, ratio
3/4-4/3, one box per file and round, seeded): the largest factor in {1, 2, 4, 8} that leaves the box's shorter side
at least 224 px. Decoding only: the crop and resize that follow are the same work on fewer pixels.

    python benchmarks/scaled_decode.py --files 12 --rounds 3 --json out.json
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import io
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from PIL import Image
from torchvision.transforms import RandomResizedCrop

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
from photos import render  # noqa: E402  benchmarks/photos.py: photo-like content at quality 90

from imgtrain.data.decoders import cpu_decoder  # noqa: E402

# optional, not a dependency: found by name, so that tests/test_gpu_suite.py's check of every import does not ask
# for it; where it is missing its rows are left out and the table says so
simplejpeg = importlib.import_module("simplejpeg") if importlib.util.find_spec("simplejpeg") else None

SETS = {"6mp": (3000, 2000), "12mp": (4000, 3000), "imagenet": (500, 375)}
CROP, VAL_RESIZE = 224, 256
FACTORS = (8, 4, 2, 1)


def needed_side(use: str, size: tuple[int, int], rng: torch.Generator) -> int:
    """The shorter side (px) of the image region the use needs at full scale, over the side it becomes."""
    width, height = size
    if use == "val":  # the shorter side becomes VAL_RESIZE
        return min(width, height) // VAL_RESIZE
    crop = RandomResizedCrop(CROP)
    _, _, box_h, box_w = crop.get_params(torch.zeros(1, height, width), crop.scale, crop.ratio)
    return min(box_w, box_h) // CROP


def factor_for(ratio: int) -> int:
    """The largest libjpeg-turbo scale factor that decodes at least the pixels the use needs."""
    return next(f for f in FACTORS if f <= max(ratio, 1))


def decoders() -> dict[str, Callable[[bytes, tuple[int, int], int], object]]:
    codec = cpu_decoder()

    def full_codec(data: bytes, size: tuple[int, int], factor: int) -> object:
        return codec.decode(torch.frombuffer(bytearray(data), dtype=torch.uint8))

    def full_pil(data: bytes, size: tuple[int, int], factor: int) -> object:
        with Image.open(io.BytesIO(data)) as image:
            return np.asarray(image.convert("RGB"))

    def draft_pil(data: bytes, size: tuple[int, int], factor: int) -> object:
        with Image.open(io.BytesIO(data)) as image:
            image.draft("RGB", (size[0] // factor, size[1] // factor))
            return np.asarray(image.convert("RGB"))

    found = {"torchcodec (full)": full_codec, "PIL (full)": full_pil, "PIL draft (scaled)": draft_pil}
    if simplejpeg is not None:
        found["simplejpeg (scaled)"] = lambda data, size, factor: simplejpeg.decode_jpeg(
            data, colorspace="RGB", min_width=size[0] // factor, min_height=size[1] // factor
        )
    return found


def measure(files: int, rounds: int, seed: int) -> dict:
    torch.set_num_threads(1)
    rng = np.random.default_rng(seed)
    data = {name: [render(*size, rng) for _ in range(files)] for name, size in SETS.items()}
    found = decoders()
    rates: dict[str, dict[str, list[float]]] = {}
    for round_ in range(rounds):
        for name, size in SETS.items():
            for use in ("rrc", "val"):
                draws = torch.Generator().manual_seed(seed + round_)
                torch.manual_seed(seed + round_)  # get_params draws from the global generator
                factors = [factor_for(needed_side(use, size, draws)) for _ in data[name]]
                for decoder, decode in found.items():
                    started = time.perf_counter()
                    for blob, factor in zip(data[name], factors, strict=True):
                        decode(blob, size, factor)
                    rate = len(factors) / (time.perf_counter() - started)
                    rates.setdefault(f"{name} {use}", {}).setdefault(decoder, []).append(rate)
                rates[f"{name} {use}"].setdefault("factors", []).append(statistics.median(factors))
    return {"files": files, "rounds": rounds, "seed": seed, "simplejpeg": simplejpeg is not None, "rates": rates}


def table(result: dict) -> str:
    lines = ["| files, use | decoder | images/s, one core (median; range) | x full decode (median; range) |"]
    lines.append("| --- | --- | ---: | ---: |")
    for row, by_decoder in result["rates"].items():
        base = by_decoder["torchcodec (full)"]
        for decoder, values in by_decoder.items():
            if decoder == "factors":
                continue
            ratios = [v / b for v, b in zip(values, base, strict=True)]
            lines.append(
                f"| {row} (factor {statistics.median(by_decoder['factors']):g}) | {decoder} | "
                f"{statistics.median(values):,.1f} ({min(values):,.1f}-{max(values):,.1f}) | "
                f"{statistics.median(ratios):.2f}x ({min(ratios):.2f}-{max(ratios):.2f}) |"
            )
    if not result["simplejpeg"]:
        lines.append("\nsimplejpeg: not installed here (pip install simplejpeg), not measured.")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--files", type=int, default=12, help="files per set (default 12)")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds (default 3)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, help="write the rates here")
    args = parser.parse_args()
    result = measure(args.files, args.rounds, args.seed)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=1))
    print(table(result))


if __name__ == "__main__":
    main()
