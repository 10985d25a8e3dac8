"""Loader threads or worker processes for data.engine=threads: the project's DataLoader with N worker processes
against torchdata.nodes and SPDL with N threads, at equal N, over the same per-sample work (the project's Dataset,
seeding and collate: engines.py), in interleaved rounds, each run a fresh process (child.py).

    python benchmarks/threads/measure.py [--rounds 5] [--workers 1,2] [--datasets photos,shapes]
        [--policies rrc_flip,trivialaugment] [--out FILE.json]

run with a Python that has torchdata 0.11.0 and spdl 0.8.0 on top of the project's packages (the recipe:
docs/engine-evaluation/threads.md). Datasets: `photos`, 500x375 and 375x500 photo-like JPEGs (recipes.photo_folder,
the folder of bench.py's augment-loaders section) through dataset=imagefolder's builder, 224-px crops; `shapes`, the
default dataset at 32 px. Per run: images/s over the steady part of every epoch, the time to the first batch, each
later epoch's start stall, and the peak PSS of the run's process tree (the process and its worker processes,
sampled from this process by a thread, so the sampling takes no GIL from a threaded loader). The engine order is
rotated every round. Prints each run, then medians with min-max spreads; writes every raw figure to --out.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.metadata
import json
import os
import platform
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import psutil

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))  # benchmarks/: recipes.photo_folder
from child import SHAPES_VAL  # noqa: E402
from engines import ENGINES  # noqa: E402
from recipes import photo_folder  # noqa: E402
from summary import summarize, table  # noqa: E402

from imgtrain.config.datasets import ShapesConfig  # noqa: E402
from imgtrain.data.shapes import ensure_shapes  # noqa: E402
from imgtrain.host.cpus import available_cpus  # noqa: E402

PHOTO = (500, 375)  # ImageNet's commonest size (a quarter of the files portrait: recipes.photo_folder)
CLASSES = 10  # recipes.photo_folder's class folders
VERSIONS = ("torch", "torchvision", "torchcodec", "torchdata", "spdl", "spdl_core")


def prepare(args: argparse.Namespace) -> dict[str, dict[str, Any]]:
    """Each dataset's child arguments, its files generated once (before any measurement) in --workdir."""
    work = Path(args.workdir).expanduser()
    out: dict[str, dict[str, Any]] = {}
    if "photos" in args.datasets:
        root = photo_folder(work, max(1, args.photos // CLASSES), PHOTO)
        out["photos"] = {"root": str(root), "images": 0}
    if "shapes" in args.datasets:
        root = work / "shapes"
        shapes = ShapesConfig()
        ensure_shapes(str(root), shapes.image_size, args.shapes, SHAPES_VAL, shapes.seed, processes=available_cpus())
        out["shapes"] = {"root": str(root), "images": args.shapes}
    return out


def tree_pss(process: psutil.Process) -> int:
    """PSS bytes of `process` and all its descendants (DataLoader workers, any helper process)."""
    total = 0
    try:
        members = [process, *process.children(recursive=True)]
    except psutil.Error:
        return 0
    for member in members:
        with contextlib.suppress(psutil.Error):  # a worker that just exited
            total += member.memory_full_info().pss
    return total


def sample_pss(pid: int, interval: float, stop: threading.Event, found: dict[str, float]) -> None:
    """Until `stop`: the process tree's PSS every `interval` seconds; the peak (MiB) and sample count in `found`."""
    process = psutil.Process(pid)
    while not stop.is_set():
        pss = tree_pss(process) / 2**20
        found["peak"], found["samples"] = max(found.get("peak", 0.0), pss), found.get("samples", 0) + 1
        stop.wait(interval)


def run_one(args: argparse.Namespace, engine: str, setting: tuple[str, str, int], data: dict[str, Any]) -> dict:
    """One child run: its JSON line plus the peak PSS, or what ended it."""
    dataset, policy, workers = setting
    cmd = [args.python, str(HERE / "child.py"), "--engine", engine, "--dataset", dataset, "--root", data["root"]]
    cmd += ["--policy", policy, "--workers", str(workers), "--batch", str(args.batch), "--epochs", str(args.epochs)]
    cmd += ["--skip", str(args.skip), "--images", str(data["images"]), "--spawned", repr(time.perf_counter())]
    child = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    stop, found = threading.Event(), {}
    sampler = threading.Thread(target=sample_pss, args=(child.pid, args.pss_interval, stop, found), daemon=True)
    sampler.start()
    try:
        stdout, stderr = child.communicate(timeout=args.timeout)
    except subprocess.TimeoutExpired:
        child.kill()
        stdout, stderr = child.communicate()
        stderr += f"\ntimed out after {args.timeout} s"
    stop.set()
    sampler.join()
    base = {"engine": engine, "dataset": dataset, "policy": policy, "workers": workers}
    lines = stdout.strip().splitlines()
    if child.returncode != 0 or not lines:
        tail = (stderr or stdout).strip().splitlines()
        return base | {"error": tail[-1] if tail else f"exit {child.returncode}", "rc": child.returncode}
    pss = {"peak_pss_mib": found.get("peak"), "pss_samples": found.get("samples", 0)}
    return json.loads(lines[-1]) | pss


def describe(run: dict[str, Any]) -> str:
    if "error" in run:
        return f"FAILED: {run['error']}"
    stall = ", ".join(f"{s:.3f}" for s in run["stall_s"])
    rate = run["images_per_sec"]
    return (
        f"{rate if rate is None else round(rate):>6} images/s, first batch {run['first_batch_s']:.2f} s, "
        f"stall [{stall}] s, peak PSS {run['peak_pss_mib'] or 0:.0f} MiB"
    )


def versions() -> dict[str, str | None]:
    found: dict[str, str | None] = {}
    for name in VERSIONS:
        try:
            found[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            found[name] = None
    return found


def machine() -> dict[str, Any]:
    return {
        "cpus": available_cpus(),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "load_average_1min": os.getloadavg()[0],
        "versions": versions(),
    }


def measure(args: argparse.Namespace) -> dict[str, Any]:
    data = prepare(args)
    settings = [(d, p, w) for d in args.datasets for p in args.policies for w in args.workers]
    report: dict[str, Any] = {"args": vars(args), "machine": machine(), "runs": []}
    for round_ in range(args.rounds):
        order = args.engines[round_ % len(args.engines) :] + args.engines[: round_ % len(args.engines)]
        for setting in settings:
            for engine in order:
                run = run_one(args, engine, setting, data[setting[0]]) | {"round": round_}
                report["runs"].append(run)
                print(f"round {round_} {'/'.join(map(str, setting))} {engine:10s} {describe(run)}", flush=True)
    report["machine"]["load_average_1min_after"] = os.getloadavg()[0]
    report["summary"] = summarize(report["runs"])
    return report


def parse(argv: list[str] | None) -> argparse.Namespace:
    listed = lambda kind: lambda text: [kind(v) for v in text.split(",") if v]  # noqa: E731
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--engines", type=listed(str), default=list(ENGINES), help="comma-separated")
    parser.add_argument("--datasets", type=listed(str), default=["photos", "shapes"], help="photos and/or shapes")
    parser.add_argument("--policies", type=listed(str), default=["rrc_flip", "trivialaugment"], help="dataset.augment")
    parser.add_argument("--workers", type=listed(int), default=[1, 2], help="worker processes = threads, e.g. 1,2")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--photos", type=int, default=2560, help="training JPEGs of 500x375 (10 classes)")
    parser.add_argument("--shapes", type=int, default=5000, help="training images of shapes (32 px)")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--epochs", type=int, default=3, help="the stall is measured at every epoch after the first")
    parser.add_argument("--skip", type=int, default=-1, help="batches before each epoch's steady part (-1: 2N+1)")
    parser.add_argument("--pss-interval", type=float, default=0.2, help="seconds between PSS samples")
    parser.add_argument("--timeout", type=float, default=1800, help="seconds for one run")
    parser.add_argument("--workdir", default="~/.cache/imgtrain-threads", help="where the datasets are generated")
    parser.add_argument("--python", default=sys.executable, help="the interpreter of the runs (torchdata, spdl)")
    parser.add_argument("--out", default="", help="the JSON of every run (default: <workdir>/threads-<time>.json)")
    args = parser.parse_args(argv)
    unknown = set(args.engines) - set(ENGINES)
    if unknown:
        parser.error(f"unknown engine(s) {sorted(unknown)}: choose among {', '.join(ENGINES)}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    report = measure(args)
    out = Path(args.out or Path(args.workdir).expanduser() / time.strftime("threads-%Y%m%d-%H%M%S.json"))
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1))
    print("\n".join(["", *table(report["summary"]), "", f"every run: {out}"]))
    return 0 if not any("error" in r for r in report["runs"]) else 1


if __name__ == "__main__":
    sys.exit(main())
