"""The device half of the batched input path (data/resample.py), measured on a machine without a GPU.

Two parts, each interleaved, with medians and spreads:

- `dispatch`: what the GPU-side crop-resize-flip of one batch costs the host: Python and dispatch only, the work
  that holds the GIL in the decode thread (dataset.decode=cuda) or the training thread (data.augment_on=device).
  The images are tiny CPU tensors (each side 1/32 of the real one, the crop 7 px) so that the kernels cost almost
  nothing and the time is the Python and dispatch around them (`meta` tensors would run no kernel at all, but
  many of their shape functions are Python, slower than the CPU kernels here). Against the per-image path of
  9a14468 (a crop view and one antialiased interpolate per image, copied below as `per_image_crops`). Also
  counts the aten ops each path dispatches at the real sizes, and those of them that are not views (each of
  these is a kernel launch on a GPU).
- `workers`: `mode=loader` on `shapes` at 32 px with 1 worker, data.augment_on=workers against device: what the
  worker spends per image when the crop moves to the device (on this CPU-only machine the training process then
  crops, so the images/s here are not the GPU's).

    python benchmarks/device_augment.py [--rounds 7] [--out benchmarks/results/<date>-device-augment.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).resolve().parent))
from batched_augment import figures, run_train  # noqa: E402

from imgtrain.data import batched, resample  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
BATCH = 256
SIZES = {  # (H, W) of the batch's images
    "384 px shapes (bench.py gpu-jpeg folder)": [(384, 384)] * BATCH,
    "ImageNet-like mixed (500x375, 375x500, 500x333, 333x500)": [
        [(375, 500), (500, 375), (333, 500), (500, 333)][i % 4] for i in range(BATCH)
    ],
}
SPEC = batched.CropSpec(224, (0.35, 1.0), flip_p=0.5)  # the training transform of imagefolder
SHRINK = 32  # the timed images' sides are the real ones / SHRINK, and the crop SPEC.size / SHRINK


def per_image_crops(images: list[torch.Tensor], seeds: np.ndarray) -> torch.Tensor:
    """9a14468's JpegBatchDecoder._random_resized_crops and flip (the baseline), unchanged but for its inputs."""
    spec, draws = _spec_for(images), batched.uniforms(seeds, batched.DRAWS)
    out = []
    for image, (top, left, height, width) in zip(images, batched.image_boxes(images, draws, spec), strict=True):
        patch = image[None, :, top : top + height, left : left + width].float()
        out.append(F.interpolate(patch, size=[spec.size, spec.size], mode="bilinear", antialias=True))
    crops = torch.cat(out)
    flip = torch.from_numpy(draws[:, -1] < SPEC.flip_p).to(crops.device, non_blocking=True)
    return torch.where(flip[:, None, None, None], crops.flip(-1), crops)


def two_matmuls(images: list[torch.Tensor], seeds: np.ndarray) -> torch.Tensor:
    """Today's path (gpu_decode.JpegBatchDecoder._transform): the plan, the windows in chunks, two batched matmuls."""
    spec = _spec_for(images)
    plan = resample.plan_batch(*resample.sizes_of(images), seeds, spec)
    return resample.resample_images(images, plan, spec.size)


def _spec_for(images: list[torch.Tensor]) -> batched.CropSpec:
    """SPEC, its crop shrunk with the images (the op counts come from real-size images)."""
    tiny = max(images[0].shape[-2:]) < 100
    return batched.CropSpec(SPEC.size // SHRINK, SPEC.scale, flip_p=SPEC.flip_p) if tiny else SPEC


VIEWS = {"slice", "select", "view", "_unsafe_view", "as_strided", "alias", "expand", "unsqueeze", "transpose", "t"}
VIEWS |= {"permute", "detach", "unbind", "split", "lift_fresh"}  # no kernel: metadata, or a tensor made from host data


class OpCounter(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[str(func.overloadpacket.__name__)] += 1
        return func(*args, **(kwargs or {}))


def dispatch(rounds: int) -> dict:
    paths = {"per_image_9a14468": per_image_crops, "two_matmuls": two_matmuls}
    seeds = np.arange(BATCH, dtype=np.int64) * 7919
    result = {}
    for name, sizes in SIZES.items():
        images = [torch.zeros((3, h // SHRINK, w // SHRINK), dtype=torch.uint8) for h, w in sizes]
        times: dict[str, list[float]] = {path: [] for path in paths}
        for call in paths.values():  # one warm-up call each
            call(images, seeds)
        for _ in range(rounds):
            for path, call in paths.items():
                started = time.perf_counter()
                call(images, seeds)
                times[path].append((time.perf_counter() - started) * 1e3)
        counts = {}
        real = [torch.empty((3, h, w), dtype=torch.uint8, device="meta") for h, w in sizes]
        for path, call in paths.items():
            with OpCounter() as counter:
                call(real, seeds)
            kernels = sum(n for op, n in counter.ops.items() if op not in VIEWS)
            counts[path] = {
                "total": sum(counter.ops.values()),
                "kernels": kernels,
                "by_op": dict(counter.ops.most_common(8)),
            }
        cells = {path: _spread(values) for path, values in times.items()}
        ratio = cells["per_image_9a14468"]["median"] / cells["two_matmuls"]["median"]
        result[name] = {"host_ms_per_batch": cells, "aten_ops_per_batch": counts, "speedup_of_medians": ratio}
    return result


def workers(rounds: int, steps: int) -> dict:
    common = ["mode=loader", "dataset=shapes", "dataset.image_size=32", "data.num_workers=1", "system.device=cpu"]
    common += [f"train.max_steps={steps}", "train.epochs=1000", "metrics.skip_first_steps=20"]
    common += ["metrics.log_every_n_steps=20", "checkpoint.save=false", "metrics.progress_bar=false"]
    common += ["checkpoint.resume=none"]
    places = ("workers", "device")
    runs = []
    with tempfile.TemporaryDirectory() as scratch:
        data_dir = Path(scratch) / "data"
        for repeat in range(rounds):
            for place in places:
                run_dir = Path(scratch) / f"{place}-{repeat}"
                metrics = run_train(ROOT, [*common, f"data.augment_on={place}"], run_dir, data_dir, 900)
                stages = (metrics.get("pipeline") or {}).get("stage_ms_per_image") or {}
                runs.append({"place": place, "repeat": repeat, **figures(metrics), "stages": stages})
    summary = {}
    for place in places:
        mine = [r for r in runs if r["place"] == place]
        summary[place] = {
            "images_per_sec": _spread([r["images_per_sec"] for r in mine]),
            "worker_busy_cores": _spread([r["worker_busy_cores"] for r in mine]),
            "per_busy_core": _spread([r["per_busy_core"] for r in mine]),
            "augment_ms_per_image": _spread([r["stages"].get("augment") for r in mine]),
        }
    pairs = [
        next(r for r in runs if r["repeat"] == k and r["place"] == "device")["per_busy_core"]
        / next(r for r in runs if r["repeat"] == k and r["place"] == "workers")["per_busy_core"]
        for k in range(rounds)
    ]
    return {"command": common, "summary": summary, "per_busy_core_ratio_per_pair": _spread(pairs), "runs": runs}


def _spread(values: list[float | None]) -> dict | None:
    values = [v for v in values if v is not None]
    if not values:
        return None
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "n": len(values)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--parts", default="dispatch,workers")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    parts = args.parts.split(",")
    out = {"date": time.strftime("%Y-%m-%d %H:%M"), "torch": torch.__version__, "batch": BATCH}
    if "dispatch" in parts:
        out["dispatch"] = dispatch(args.rounds)
    if "workers" in parts:
        out["workers"] = workers(args.rounds, args.steps)
    text = json.dumps(out, indent=1)
    print(text)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text)


if __name__ == "__main__":
    main()
