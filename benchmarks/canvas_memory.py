"""Peak memory of the device-side crop, resize and flip of one batch (data/resample.py), before and after issue 29's
bound (item 2.5), in one invocation.

"Before" is af14a6e's resample.py, read with `git show` (the whole batch on one zero canvas of its largest image,
the weights broadcast over the channels); "after" is the working tree's (windows, chunks of CHUNK_BYTES, channels
folded into the matmuls). Both run on CPU tensors in float16, as on CUDA, for the two callers:

- `decode` (dataset.decode=cuda, `JpegBatchDecoder._transform`): the decoded images in, the crops out;
- `device` (data.augment_on=device, `RawBatch.resampled`): the canvas the worker ships (uint8) in, the crops out.

Peaks are counted by torch's MemTracker under FakeTensorMode: no memory is allocated, so af14a6e's 30 GB case runs
on this 24 GB machine. Counted: every tensor storage created while the call runs, the inputs (uint8, created
first, inside the count), the plan and the output included. Not counted: memory a kernel takes without a tensor
(scratch space), and a CUDA caching allocator's rounding. `--validate` runs the 256-image cases of the `decode`
path for real and sets beside the tracker torch.profiler's allocator events summed in time order and the
process's resident high-water mark (VmHWM, reset through /proc/self/clear_refs) above its resident size before,
each run in a fresh process (in a used one, malloc hands back memory it already holds without raising it).

    python benchmarks/canvas_memory.py [--validate] [--out benchmarks/results/<date>-canvas-memory.json]
"""

from __future__ import annotations

import argparse
import json
import platform
import re
import subprocess
import sys
import time
import types
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from torch._subclasses import FakeTensorMode
from torch.distributed._tools.mem_tracker import MemTracker
from torch.profiler import ProfilerActivity, profile
from torch.utils._python_dispatch import TorchDispatchMode

from imgtrain.data import batched
from imgtrain.data import resample as after

BASE = "af14a6e"
BATCH = 256
MIX = [(375, 500), (500, 375)]  # (H, W): ImageNet's two common shapes, alternating in the batch
PHOTO = (3000, 4000)  # one 12-megapixel photo, last in the batch of case (b)
SPECS = {
    "train": batched.CropSpec(224, (0.35, 1.0), flip_p=0.5),  # imagefolder's training transform at 224 px
    "eval": batched.CropSpec(224, resize=256),  # Resize(256) + CenterCrop(224)
}
HALF = torch.float16  # CUDA's default dtype for the matmuls


def load_base() -> types.ModuleType:
    """af14a6e's data/resample.py as a module, from git."""
    root = Path(__file__).resolve().parent.parent
    source = subprocess.run(
        ["git", "show", f"{BASE}:src/imgtrain/data/resample.py"], cwd=root, check=True, capture_output=True, text=True
    ).stdout
    module = types.ModuleType("resample_af14a6e")
    exec(compile(source, f"{BASE}:resample.py", "exec"), module.__dict__)  # noqa: S102 - the repository's own code
    return module


def batch_sizes(photo: bool) -> list[tuple[int, int]]:
    sizes = [MIX[i % 2] for i in range(BATCH)]
    return sizes[:-1] + [PHOTO] if photo else sizes


def plan_of(sizes: list[tuple[int, int]], spec: batched.CropSpec) -> np.ndarray:
    heights, widths = (np.array(side, dtype=np.int64) for side in zip(*sizes, strict=True))
    return after.plan_batch(heights, widths, np.arange(len(sizes)), spec)  # the seeds: 0..B-1


def paths(base: types.ModuleType, sizes: list[tuple[int, int]], spec: batched.CropSpec) -> dict:
    """Per "path version": (a function making the inputs, a function of them making the batch's crops); and the
    canvas each version's worker ships (elements, uint8) under "shipped"."""
    plan, size = plan_of(sizes, spec), spec.size

    def shipped(canvas_of: Callable) -> tuple[tuple[int, ...], np.ndarray]:  # the worker's canvas: shape and plan
        with FakeTensorMode():
            canvas, plan_shipped = canvas_of([torch.empty((3, h, w), dtype=torch.uint8) for h, w in sizes])
        return tuple(canvas.shape), plan_shipped

    shape_before, plan_before = shipped(lambda images: (base.canvas(images), plan))
    shape_after, plan_after = shipped(lambda images: after.window_canvas(images, plan, size))
    with FakeTensorMode():
        fakes = [torch.empty((3, h, w), dtype=torch.uint8) for h, w in sizes]
        decode_chunks = len(after.chunk_windows(fakes, plan, size, 3 * HALF.itemsize, after.CHUNK_BYTES))
    per_chunk = max(1, after.CHUNK_BYTES // (int(np.prod(shape_after[1:])) * HALF.itemsize))  # as `resample` takes them

    def images() -> list[torch.Tensor]:
        return [torch.randint(0, 256, (3, h, w), dtype=torch.uint8) for h, w in sizes]

    def received(shape: tuple[int, ...]) -> Callable[[], torch.Tensor]:
        return lambda: torch.randint(0, 256, shape, dtype=torch.uint8)

    return {
        "decode before": (images, lambda x: base.resample(base.canvas(x), torch.from_numpy(plan), size, HALF)),
        "decode after": (images, lambda x: after.resample_images(x, plan, size, HALF)),
        "device before": (
            received(shape_before),
            lambda x: base.resample(x, torch.from_numpy(plan_before), size, HALF),
        ),
        "device after": (received(shape_after), lambda x: after.resample(x, torch.from_numpy(plan_after), size, HALF)),
        "shipped": {"before": int(np.prod(shape_before)), "after": int(np.prod(shape_after))},
        "chunks": {"decode": decode_chunks, "device": -(-len(sizes) // per_chunk)},
    }


NOT_KERNELS = {torch.ops.aten._unsafe_view.default}  # a view, though not marked as one


class Kernels(TorchDispatchMode):
    """Counts the aten ops that are not views (prim.device and the like left out): each is about a kernel launch on
    a GPU."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204 - torch's signature
        self.count += func.namespace == "aten" and not func.is_view and func not in NOT_KERNELS
        return func(*args, **(kwargs or {}))


def tracked_peak(inputs: Callable, compute: Callable) -> tuple[int, int]:
    """(peak bytes of live tensor storages, kernels of `compute` alone) of `compute(inputs())` under
    FakeTensorMode: nothing is allocated."""
    with FakeTensorMode(allow_non_fake_inputs=True):
        tracker, kernels = MemTracker(), Kernels()
        with tracker:
            x = inputs()
            with kernels:
                out = compute(x)
            del out, x
        return max(snap["Total"] for snap in tracker.get_tracker_snapshot("peak").values()), kernels.count


def profiled_peak(inputs: Callable, compute: Callable) -> int:
    """Peak bytes of `compute(inputs())` for real: torch.profiler's CPU allocator events, summed in time order."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        x = inputs()
        out = compute(x)
        del out, x
    events = sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events() if e.name() == "[memory]")
    return int(np.cumsum([nbytes for _, nbytes in events]).max())


def resident_peak(inputs: Callable, compute: Callable) -> int:
    """Bytes the process's resident high-water mark rises above its resident size before `compute(inputs())`: all
    memory touched, kernels' scratch included, but not memory malloc reuses from what the process already holds."""
    Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current resident size
    before = _status("VmRSS")
    x = inputs()
    out = compute(x)
    del out, x
    return _status("VmHWM") - before


def _in_a_fresh_process(case: str, spec: str, version: str) -> int:
    command = [sys.executable, __file__, "--resident", case, spec, version]
    return int(subprocess.run(command, check=True, capture_output=True, text=True).stdout.split()[-1])


def _status(field: str) -> int:
    return int(re.search(rf"{field}:\s+(\d+) kB", Path("/proc/self/status").read_text()).group(1)) * 1024


def measure(validate: bool) -> dict:
    base = load_base()
    rows, checks = [], []
    for case, photo in (("a", False), ("b", True)):
        for name, spec in SPECS.items():
            sizes = batch_sizes(photo)
            runs = paths(base, sizes, spec)
            for path in ("decode", "device"):
                peaks = {v: tracked_peak(*runs[f"{path} {v}"]) for v in ("before", "after")}
                row = {"case": case, "spec": name, "path": path, "images": len(sizes), "photo": photo}
                row |= {f"{v}_bytes": peak for v, (peak, _) in peaks.items()}
                row |= {f"{v}_kernels": kernels for v, (_, kernels) in peaks.items()}
                row["after_chunks"] = runs["chunks"][path]
                if path == "device":
                    row |= {f"shipped_{v}_bytes": n for v, n in runs["shipped"].items()}
                rows.append(row)
                print(_line(row), flush=True)
            if validate and not photo:
                for version in ("before", "after"):
                    run = runs[f"decode {version}"]
                    check = {"case": case, "spec": name, "path": "decode", "version": version}
                    check |= {"tracker_bytes": tracked_peak(*run)[0], "profiler_bytes": profiled_peak(*run)}
                    check["resident_bytes"] = _in_a_fresh_process(case, name, version)
                    checks.append(check)
                    print(check, flush=True)
    return {"rows": rows, "validation": checks}


def _line(row: dict) -> str:
    before, after_ = row["before_bytes"] / 1e6, row["after_bytes"] / 1e6
    return f"{row['case']} {row['spec']} {row['path']}: {before:,.0f} -> {after_:,.0f} MB"


def table(results: dict) -> str:
    lines = [
        "| case | path | before peak (MB) | after peak (MB) | ratio | chunks after | kernels before -> after |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in results["rows"]:
        case = f"({r['case']}) {r['spec']}" + (", one 4000×3000 photo" if r["photo"] else "")
        ratio = r["before_bytes"] / r["after_bytes"]
        lines.append(
            f"| {case} | {r['path']} | {r['before_bytes'] / 1e6:,.0f} | {r['after_bytes'] / 1e6:,.0f} | {ratio:.1f}× "
            f"| {r['after_chunks']} | {r['before_kernels']} -> {r['after_kernels']} |"
        )
    shipped = [r for r in results["rows"] if r["path"] == "device"]
    lines += ["", "| case | worker canvas before (MB) | after (MB) |", "| --- | ---: | ---: |"]
    for r in shipped:
        case = f"({r['case']}) {r['spec']}" + (", one 4000×3000 photo" if r["photo"] else "")
        lines.append(f"| {case} | {r['shipped_before_bytes'] / 1e6:,.0f} | {r['shipped_after_bytes'] / 1e6:,.0f} |")
    if results["validation"]:
        lines += [
            "",
            "| real run | tracker (MB) | profiler (MB) | resident high-water (MB) |",
            "| --- | ---: | ---: | ---: |",
        ]
        for c in results["validation"]:
            lines.append(
                f"| ({c['case']}) {c['spec']} {c['path']} {c['version']} | {c['tracker_bytes'] / 1e6:,.1f} "
                f"| {c['profiler_bytes'] / 1e6:,.1f} | {c['resident_bytes'] / 1e6:,.1f} |"
            )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--validate", action="store_true", help="also run the 256-image mix for real")
    parser.add_argument("--out", type=Path, default=None, help="JSON (default benchmarks/results/<date>-canvas-memory)")
    parser.add_argument("--resident", nargs=3, metavar=("CASE", "SPEC", "VERSION"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.resident:  # one real run of the decode path, its resident peak printed (`--validate` starts these)
        case, spec, version = args.resident
        runs = paths(load_base(), batch_sizes(case == "b"), SPECS[spec])
        print(resident_peak(*runs[f"decode {version}"]))
        return
    torch.manual_seed(0)
    started = time.strftime("%Y-%m-%d %H:%M")
    results = measure(args.validate)
    print(table(results))
    out = args.out or Path(__file__).parent / "results" / f"{time.strftime('%Y-%m-%d')}-canvas-memory.json"
    meta = {"started": started, "command": " ".join([Path(sys.executable).name, *sys.argv]), "base": BASE}
    meta |= {"torch": torch.__version__, "machine": platform.processor() or platform.machine(), "cpus": _cpus()}
    meta |= {"chunk_bytes": after.CHUNK_BYTES, "dtype": str(HALF), "batch": BATCH}
    out.write_text(json.dumps(meta | results, indent=1) + "\n")
    print(f"wrote {out}")


def _cpus() -> int:
    return len(__import__("os").sched_getaffinity(0))


if __name__ == "__main__":
    main()
