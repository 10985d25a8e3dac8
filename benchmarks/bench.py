"""The benchmark harness: `make bench` (full) or `make bench-quick` (the smoke test CI runs).

Sections, in one invocation on this machine (`--only` picks some, e.g. `--only gpu-ceilings`):
  overhead      train.py against benchmarks/bare_loop.py, median of N interleaved runs each;
  modes         the three modes (loader, compute, train) for synthetic, shapes and imagefolder, plus the
                device-resident train path;
  workers       loader throughput (mode=loader, shapes) as data.num_workers grows to the CPU count;
  checkpoint    the cost of checkpointing: images/s with last.pt every 30 s of training and at the default
                settings, against no checkpoints, interleaved (CPU: ResNet-18 at 32 px, about 16 minutes on 2
                cores; CUDA: ResNet-50 at 224 px);
  gpu-ceilings  ResNet-18 CIFAR-style at 32 px: compute ceiling, device-resident and DataLoader paths (with the
                loader's own ceiling per worker count), and the ceiling and device-resident path compiled with
                CUDA graphs (system.compile_mode=reduce_overhead); ResNet-50 at 224 px on synthetic data. About
                4 minutes on one H100, plus two compilations;
  gpu-jpeg      ResNet-50 at 224 px from a JPEG folder of ImageNet's mix of sizes with 3% 12-MP photos
                (benchmarks/photos.py, the folder gpu-check reads): CPU decode and dataset.decode=cuda, and timm's
                train.py on the same folder when --timm-train is given. About 5 minutes on one H100;
  storage       the same JPEGs as a folder and as shards (dataset=shards), read by one loader worker from the page
                cache and from a store that charges 5 ms per file open (benchmarks/storage.py); about 9 minutes;
  decode-cpu, resize-kernels  kernels timed in this process on one thread (benchmarks/kernels.py): CPU JPEG
                decode, torchvision's against imgtrain's; the crop-and-resize kernels data/batched.py chooses
                between. About 10 s each on 2 cores;
  augment-loaders  the training loader's images/s per worker with dataset.augment=rrc_flip, trivialaugment and
                randaugment on 500x375 JPEGs, against timm 1.0.28's create_loader with the nearest policy it has (its
                wheel from the peer kit, in a directory of its own), interleaved rounds (benchmarks/recipes.py); about
                15 minutes on 2 cores;
  recipe-cost   the cost per step of mixup/cutmix and of EMA: train.py, ResNet-18 at 32 px on synthetic data, against
                the same run without them, interleaved rounds (benchmarks/recipes.py); about 5 minutes on 2 cores;
  threads       train.py with data.engine=dataloader against data.engine=threads at data.num_workers 1 and 2, mode=train
                and mode=loader, on the CPU with a tiny model: 500x375 JPEGs (224-px crops, rrc_flip and
                trivialaugment) and shapes at 32 px, 3 epochs a run, interleaved rounds (3; --repeats): images/s, the
                ratio per round, PSS peak, epoch-start stall, first batch, data wait (benchmarks/threads_train.py;
                24 runs a round; skipped in one line without torchdata);
  big-photos    the training loader on 6- and 12-MP photos and ImageNet-sized JPEGs: the full decode, scaled decoding
                (dataset.scaled_decode) and shards packed at --max-side 512, on one core and with 2 workers, training
                and validation, interleaved rounds (3; --repeats), and the goals judged (benchmarks/big_photos.py;
                about 10 minutes on 2 cores, the ImageNet-sized rows at least 2 s each);
  per-core      the training loader on one core (data.num_workers=0, rrc_flip at 224 px) against a bare decode of the
                same 512 ImageNet-sized JPEGs and torchvision's per-sample crop, interleaved rounds (5; --repeats), and
                the instructions each takes per image under valgrind's callgrind, with the functions they go to
                (benchmarks/per_core.py; about 1 minute, and about 8 more for the counts where valgrind is installed).
The GPU sections run only where CUDA is available, otherwise their rows say "not measured". Every GPU row
measures at least 200 steady-state steps. Every figure comes from a real run's metrics.json (or the bare
loop's or timm's output, or, for the kernel sections, this process's clock); nothing is estimated. Results go
to a JSON file and, as a dated markdown section, to BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import re
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torchvision
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
import big_photos  # noqa: E402  (benchmarks/big_photos.py)
import gpu_rows  # noqa: E402  (benchmarks/gpu_rows.py: the GPU rows' overrides, shared with gpu_check.py)
import kernels  # noqa: E402  (benchmarks/kernels.py)
import per_core  # noqa: E402  (benchmarks/per_core.py)
import photos  # noqa: E402  (benchmarks/photos.py)
import recipes  # noqa: E402  (benchmarks/recipes.py)
import threads_train  # noqa: E402  (benchmarks/threads_train.py)
from gpu_rows import GPU_STEPS, GPU_WARMUP, NOT_MEASURED, R18_BATCH, R50_BATCH  # noqa: E402
from storage import storage  # noqa: E402  (benchmarks/storage.py)

from imgtrain.data.datasets import build_shapes  # noqa: E402
from imgtrain.data.samples import GuardedSamples, collate  # noqa: E402
from imgtrain.data.shapes import ensure_shapes  # noqa: E402
from imgtrain.host.cpus import available_cpus  # noqa: E402

CKPT_WINDOW = 5  # steps per logging window in the checkpoint section
CPU_CKPT_STEPS = 200  # ResNet-18 at 32 px, batch 64, on 2 cores: about 95 s, so 3 saves 30 s apart


class Bench:
    """Runs train.py and the bare loop as subprocesses and collects their figures."""

    def __init__(self, workdir: Path, quick: bool) -> None:
        self.workdir, self.quick = workdir, quick
        self.env = {**os.environ, "IMGTRAIN_DATA_DIR": str(workdir / "data"), "PYTHONUNBUFFERED": "1"}
        self.runs = 0

    def train(self, *overrides: str, timeout: float = 1800, checkpoints: bool = False, env: dict | None = None) -> dict:
        """One train.py run (with `env` added to the environment); its metrics.json plus the command that produced
        it (its log stays in its run dir)."""
        self.runs += 1
        run_dir = self.workdir / "runs" / f"{self.runs:03d}"
        args = [*overrides, *([] if checkpoints else ["checkpoint.save=false"]), "metrics.progress_bar=false"]
        cmd = [*gpu_rows.python(), "train.py", *args, f"hydra.run.dir={run_dir}"]
        print(f"  run {self.runs:03d}: {_shown(args)}", flush=True)
        try:
            environ = {**self.env, **(env or {})}
            result = subprocess.run(cmd, cwd=ROOT, env=environ, capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            return {"command": _shown(args), "error": f"timed out after {timeout:.0f} s"}
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "output.log").write_text(result.stdout + result.stderr)
        if result.returncode != 0:
            tail = (result.stderr or result.stdout).strip().splitlines()[-1:]
            return {"command": _shown(args), "error": tail[0] if tail else f"exit {result.returncode}"}
        metrics = json.loads((run_dir / "metrics.json").read_text())
        return {"command": _shown(args), "run_dir": str(run_dir), **metrics}

    def bare(self, steps: int, warmup: int) -> dict:
        cmd = [*gpu_rows.python(), "benchmarks/bare_loop.py", f"--data-dir={self.workdir / 'data'}"]
        cmd += [f"--steps={steps}", f"--warmup={warmup}"]
        result = subprocess.run(cmd, cwd=ROOT, env=self.env, capture_output=True, text=True, timeout=1800)
        if result.returncode != 0:
            return {"error": result.stderr.strip().splitlines()[-1]}
        return json.loads(result.stdout.strip().splitlines()[-1])


def _shown(args: list[str]) -> str:
    return "python train.py " + " ".join(shlex.quote(a) for a in args if not a.startswith("metrics.progress_bar"))


def overhead(bench: Bench, repeats: int, steps: int, warmup: int) -> dict:
    """(a) train.py's steady-state images/s against the bare loop's, interleaved, median of `repeats` each."""
    ours, bare = [], []
    for i in range(repeats):
        order = ("ours", "bare") if i % 2 == 0 else ("bare", "ours")  # alternate, so drift hits both
        for which in order:
            if which == "ours":
                run = bench.train(f"train.max_steps={steps}", f"metrics.skip_first_steps={warmup}")
                ours.append(run.get("images_per_sec"))
            else:
                bare.append(bench.bare(steps, warmup).get("images_per_sec"))
    valid_ours, valid_bare = [v for v in ours if v], [v for v in bare if v]
    result = {"train_py": ours, "bare_loop": bare, "steps": steps, "warmup": warmup}
    if valid_ours and valid_bare:
        result["train_py_median"] = statistics.median(valid_ours)
        result["bare_loop_median"] = statistics.median(valid_bare)
        result["overhead"] = 1 - result["train_py_median"] / result["bare_loop_median"]
    # Each pair ran back to back, so its ratio cancels the drift between pairs (BENCHMARKS.md, noise).
    pairs = [1 - a / b for a, b in zip(ours, bare, strict=True) if a and b]
    if pairs:
        result["overhead_pairs"] = pairs
        result["overhead_pairs_median"] = statistics.median(pairs)
        result["pairs_favouring_bare"] = sum(p > 0 for p in pairs)
    return result


def imagefolder_root(bench: Bench) -> Path:
    """A JPEG ImageFolder tree (64 px shapes) for the imagefolder rows; generated once in the workdir."""
    count = (200, 50) if bench.quick else (2000, 200)
    return Path(ensure_shapes(str(bench.workdir / "data" / "folder"), 64, *count, 1))


def modes(bench: Bench, steps: int) -> list[dict]:
    """(b) loader / compute / train for each dataset, and the device-resident train path."""
    small = ["dataset.num_train=1000", "dataset.num_val=100"] if bench.quick else []
    datasets = {
        "synthetic": ["dataset=synthetic", "dataset.image_size=32", *small],
        "shapes": ["dataset=shapes", *small],
        "imagefolder": ["dataset=imagefolder", f"dataset.root={imagefolder_root(bench)}", "dataset.image_size=64"],
    }
    rows = []
    for name, args in datasets.items():
        for mode in ("loader", "compute", "train"):
            run = bench.train(*args, f"mode={mode}", f"train.max_steps={steps}")
            rows.append({"dataset": name, "mode": mode, **_figures(run)})
    run = bench.train(*datasets["shapes"], "data.device_resident=true", f"train.max_steps={steps}")
    rows.append({"dataset": "shapes", "mode": "train, data.device_resident=true", **_figures(run)})
    return rows


def workers(bench: Bench, steps: int) -> list[dict]:
    """(c) mode=loader on shapes, num_workers from 0 to the CPU count."""
    counts = sorted({0, 1, 2, *range(0, available_cpus() + 1, max(1, available_cpus() // 4))})
    rows = []
    for count in [c for c in counts if c <= available_cpus()]:
        run = bench.train("mode=loader", f"data.num_workers={count}", f"train.max_steps={steps}")
        rows.append({"num_workers": count, **_figures(run)})
    return rows


def checkpoint_cost(bench: Bench, repeats: int, steps: int) -> dict:
    """(d) Throughput with last.pt every 30 s of training, and at the default settings, against no checkpoints:
    interleaved runs in one epoch (so every save is a timed one, inside the measured windows)."""
    cuda = torch.cuda.is_available()
    if cuda:  # ResNet-50 + AdamW: a 307 MB checkpoint
        base = ["dataset=synthetic", "dataset.image_size=224", "model=resnet50", "data.batch_size=256"]
    else:  # ResNet-18 + AdamW: 134 MB
        base = ["dataset=synthetic", "dataset.image_size=32"]
    base += [f"dataset.num_train={steps * (256 if cuda else 64) + 512}", f"train.max_steps={steps}"]
    base += [f"metrics.log_every_n_steps={CKPT_WINDOW}"]  # short windows: the paired estimate below
    variants = {
        "off": ["checkpoint.save=false"],
        "every 30 s": ["checkpoint.every_min=0.5"],
        "defaults": [],
    }
    runs: dict[str, list[dict]] = {name: [] for name in variants}
    for i in range(repeats):
        order = list(variants) if i % 2 == 0 else list(reversed(variants))  # alternate, so drift hits all
        for name in order:
            run = bench.train(*base, *variants[name], checkpoints=True)
            log = Path(run["run_dir"], "output.log").read_text() if "run_dir" in run else ""
            run["saves"] = len(re.findall(r"checkpoint of step \d+: ", log))
            run["save_s"] = [float(v) for v in re.findall(r"written in ([\d.]+) s", log)]
            run["copy_s"] = [float(v) for v in re.findall(r"([\d.]+) s on the training thread", log)]
            if "run_dir" in run:  # the saves inside the measured steps (not the one at the end of the run)
                inside = [int(v) for v in re.findall(r"checkpoint of step (\d+): ", log) if int(v) < steps]
                run["stall_s"] = save_stall(Path(run["run_dir"]), inside, CKPT_WINDOW)
            runs[name].append(run)
    rows = []
    for name, done in runs.items():
        rates = [r["images_per_sec"] for r in done if r.get("images_per_sec")]
        rows.append(
            {
                "variant": name,
                "images_per_sec": statistics.median(rates) if rates else None,
                "images_per_sec_runs": rates,
                "saves_per_run": [r.get("saves") for r in done],
                "write_s": [s for r in done for s in r.get("save_s", [])],
                "copy_s": [s for r in done for s in r.get("copy_s", [])],
                "stall_s": [s for r in done for s in r.get("stall_s", [])],
                "wall_time_s": [r.get("wall_time_s") for r in done],
                "command": done[0].get("command"),
                **({"error": done[0]["error"]} if "error" in done[0] else {}),
            }
        )
    off = rows[0]["images_per_sec"]
    for row in rows[1:]:
        row["cost"] = 1 - row["images_per_sec"] / off if off and row["images_per_sec"] else None
        if row["stall_s"]:  # what one save costs, spread over the 30 s between two saves
            row["stall_per_save_s"] = statistics.mean(row["stall_s"])
            row["stall_cost_at_30s"] = row["stall_per_save_s"] / 30.0
    return {"device": "cuda" if cuda else "cpu", "steps": steps, "repeats": repeats, "rows": rows}


def save_stall(run_dir: Path, save_steps: list[int], window: int) -> list[float]:
    """Seconds each save at `save_steps` added to training, paired within the run: the two windows after the
    save (the copy, then the writer competing for the cores) against the median of nearby windows without a
    save. Run-to-run noise on a shared 2-core machine (±5%) hides a 2% cost; neighbouring windows do not."""
    events = EventAccumulator(str(run_dir / "tb"))
    events.Reload()
    seconds = {e.step: e.value * window / 1000 for e in events.Scalars("perf/step_time_ms")}  # window end -> s
    touched = {s + k * window for s in save_steps for k in (1, 2)}
    stalls = []
    for save in save_steps:
        after = [save + window, save + 2 * window]
        near = [w for w in seconds if abs(w - save) <= 8 * window and w not in touched]
        if all(w in seconds for w in after) and len(near) >= 4:
            base = statistics.median(seconds[w] for w in near)
            stalls.append(sum(seconds[w] - base for w in after))
    return stalls


# ----------------------------------------------------------------------------- GPU sections


def clock_cost(bench: Bench, rounds: int) -> dict:
    """The stage clocks alone, in this process: microseconds per image to load and collate shapes with the clocks
    on and off, alternating `rounds` times (the whole-run pairs below are noisier than this difference)."""
    bundle = build_shapes(
        "shapes", 32, [0.5] * 3, [0.25] * 3, True, str(bench.workdir / "data" / "shapes"), 2048, 64, 0
    )
    per_image: dict[str, list[float]] = {"on": [], "off": []}
    for i in range(rounds):
        for which in ("on", "off") if i % 2 == 0 else ("off", "on"):
            samples = GuardedSamples(bundle.train, timed=which == "on")
            started = time.perf_counter()
            for first in range(0, 2048, 64):
                collate([samples[index] for index in range(first, first + 64)])
            per_image[which].append(1e6 * (time.perf_counter() - started) / 2048)
    on, off = statistics.median(per_image["on"]), statistics.median(per_image["off"])
    return {"us_per_image_on": per_image["on"], "us_per_image_off": per_image["off"], "cost_us_per_image": on - off}


def stage_breakdown(bench: Bench, repeats: int, steps: int) -> dict:
    """The stage breakdown's cost: data.stage_timings on and off, interleaved, in mode=loader (the input pipeline
    is all there is to slow down) and mode=train (what users run); plus the clocks' own cost per image."""
    result: dict = {"steps": steps, "repeats": repeats, "clocks": clock_cost(bench, 2 if bench.quick else 10)}
    for mode in ("loader", "train"):
        rates: dict[str, list] = {"on": [], "off": []}
        for i in range(repeats):
            for which in ("on", "off") if i % 2 == 0 else ("off", "on"):
                flag = f"data.stage_timings={'true' if which == 'on' else 'false'}"
                run = bench.train(f"mode={mode}", f"train.max_steps={steps}", flag)
                rates[which].append(run.get("images_per_sec"))
                if which == "on" and run.get("pipeline"):
                    result.setdefault(f"{mode}_pipeline", run["pipeline"])
        row: dict = {"on": rates["on"], "off": rates["off"]}
        valid_on, valid_off = [v for v in rates["on"] if v], [v for v in rates["off"] if v]
        if valid_on and valid_off:
            row["on_median"], row["off_median"] = statistics.median(valid_on), statistics.median(valid_off)
            row["cost"] = 1 - row["on_median"] / row["off_median"]
            row["clock_share"] = result["clocks"]["cost_us_per_image"] * row["on_median"] / 1e6
        result[mode] = row
    return result


LOADER_WORKERS = (8, 12, 15)  # the DataLoader rows on the 16-core box: the best of these is the row that counts
R18, R50 = gpu_rows.r18(), gpu_rows.r50()


def _gpu_steps(steps: int, warmup: int, epoch_images: int | None = None) -> list[str]:
    return gpu_rows.steps_args(steps, warmup, epoch_images=epoch_images)


def gpu_ceilings(bench: Bench, steps: int, warmup: int) -> list[dict]:
    """ResNet-18 CIFAR-style 32 px bf16: the ceiling and the three ways to feed it; ResNet-50 224 px synthetic."""
    r18_images = R18_BATCH * (steps + 10)
    rows = [
        _gpu_row(
            bench,
            "r18_ceiling",
            "ResNet-18 CIFAR-style 32 px bf16: compute ceiling (target >= 40,000 img/s)",
            "mode=compute",
            "dataset=synthetic",
            *R18,
            *_gpu_steps(steps, warmup),
        ),
        _gpu_row(
            bench,
            "r18_resident",
            "ResNet-18 32 px: device-resident train (target >= 90% of the ceiling, GPU util >= 95%)",
            "dataset=synthetic",
            "data.device_resident=true",
            *R18,
            *_gpu_steps(steps, warmup, r18_images),
        ),
    ]
    graphs = gpu_rows.GRAPHS
    rows += [
        _gpu_row(
            bench,
            "r18_ceiling_graphs",
            "ResNet-18 32 px bf16, CUDA graphs: compute ceiling (target >= 50,000 img/s, GPU util >= 95%)",
            "mode=compute",
            "dataset=synthetic",
            *R18,
            *graphs,
            *_gpu_steps(steps, warmup),
        ),
        _gpu_row(
            bench,
            "r18_resident_graphs",
            "ResNet-18 32 px, compiled with CUDA graphs: device-resident train (target >= 90% of r18_ceiling_graphs)",
            "dataset=synthetic",
            "data.device_resident=true",
            *R18,
            *graphs,
            *_gpu_steps(steps, warmup, r18_images),
        ),
    ]
    for workers in LOADER_WORKERS:  # the loader alone first: its own ceiling explains the training row
        rows.append(
            _gpu_row(
                bench,
                f"r18_loader_only_{workers}w",
                f"shapes JPEGs, mode=loader, {workers} workers",
                "mode=loader",
                "dataset=shapes",
                f"data.num_workers={workers}",
                *R18,
                *_gpu_steps(steps, warmup, r18_images),
            )
        )
        rows.append(
            _gpu_row(
                bench,
                f"r18_dataloader_{workers}w",
                f"ResNet-18 32 px: DataLoader path, shapes JPEGs, {workers} workers (target >= 80% of the ceiling)",
                "dataset=shapes",
                f"data.num_workers={workers}",
                *R18,
                *_gpu_steps(steps, warmup, r18_images),
            )
        )
    rows.append(  # where the batch is cropped: auto puts 32-px shapes on the GPU; this row keeps it in the workers
        _gpu_row(
            bench,
            f"r18_dataloader_{LOADER_WORKERS[-1]}w_augment_in_workers",
            f"ResNet-18 32 px: DataLoader path, {LOADER_WORKERS[-1]} workers, crops in the workers (auto: on the GPU)",
            "dataset=shapes",
            f"data.num_workers={LOADER_WORKERS[-1]}",
            "data.augment_on=workers",
            *R18,
            *_gpu_steps(steps, warmup, r18_images),
        )
    )
    rows.append(
        _gpu_row(
            bench,
            "r50_ceiling",
            "ResNet-50 224 px bf16, synthetic: compute ceiling (target >= 3,000 img/s)",
            "mode=compute",
            "dataset=synthetic",
            *R50,
            *_gpu_steps(steps, warmup),
        )
    )
    return rows


def jpeg_folder(bench: Bench) -> Path:
    """The mixed-size JPEG folder (train/ and val/) of the ResNet-50 224-px rows, gpu-check's; generated once."""
    counts, scale = photos.spec(bench.quick)
    return photos.ensure_folder(bench.workdir / "data" / "photos", counts, scale=scale, processes=available_cpus())


def gpu_jpeg(bench: Bench, steps: int, warmup: int, timm: dict | None) -> dict:
    """ResNet-50 224 px bf16 from JPEG files, 15 workers: CPU decode, GPU decode, and timm on the same files."""
    workers = min(15, max(1, available_cpus() - 1))
    names = {
        "r50_jpeg_cpu": f"ResNet-50 224 px bf16, JPEG folder, {workers} workers, CPU decode",
        "r50_jpeg_cuda": f"ResNet-50 224 px bf16, JPEG folder, {workers} workers, dataset.decode=cuda (nvJPEG)",
        "r50_jpeg_cuda_compiled": "the same, system.compile=true (target >= 1.5x timm's train.py and > CPU decode)",
    }
    if not torch.cuda.is_available():  # no folder to generate: nothing here can run
        return {"rows": [_gpu_row(bench, key, target) for key, target in names.items()]}
    root = jpeg_folder(bench)
    common = gpu_rows.jpeg_args(str(root), workers, steps, warmup, gpu_rows.GPU_LOG_EVERY, R50)
    folder = photos.describe(root)
    result = {
        "folder": folder,
        "rows": [_gpu_row(bench, key, target, *common, *_jpeg_args(key)) for key, target in names.items()],
    }
    files = folder["train_files"]
    if timm:
        result["timm"] = run_timm(bench, root, workers, (steps, warmup, files // R50_BATCH), timm)
    return result


def _jpeg_args(key: str) -> list[str]:
    """r50_jpeg_<decode>[_compiled]: the decode, and torch.compile for the compiled row."""
    return [f"dataset.decode={key.split('_')[2]}"] + (["system.compile=true"] if key.endswith("_compiled") else [])


def _gpu_row(bench: Bench, key: str, target: str, *args: str) -> dict:
    if not torch.cuda.is_available():
        return {"key": key, "target": target, "note": NOT_MEASURED}
    return {"key": key, "target": target, **_figures(bench.train(*args))}


TIMM_STEP = re.compile(r"Train: (\d+) \[\s*(\d+)/(\d+).*?Time: ([0-9.]+)s")


def run_timm(bench: Bench, root: Path, workers: int, schedule: tuple[int, int, int], timm: dict) -> dict:
    """timm's unchanged train.py on the same folder, model, batch, workers, bf16 AMP and channels_last.

    Its transforms are set to ours (RandomResizedCrop scale 0.35-1, bilinear, flip; no colour jitter), its
    optimiser to AdamW. Steady-state images/s: the per-update times it logs, after the same warm-up steps.
    `schedule` is (steps, warm-up steps, steps per epoch).
    """
    steps, warmup, per_epoch = schedule
    epochs = -(-steps // max(1, per_epoch))  # enough epochs for `steps` updates
    args = ["--data-dir", str(root), "--model", "resnet50", "--num-classes", "10", "-b", str(R50_BATCH),
            "-j", str(workers), "--amp", "--amp-dtype", "bfloat16", "--channels-last",
            "--input-size", "3", "224", "224", "--epochs", str(epochs), "--log-interval", "1",
            "--val-split", "val", "--pin-mem", "--opt", "adamw", "--lr", "2e-3", "--weight-decay", "0.05",
            "--sched", "cosine", "--warmup-epochs", "0", "--scale", "0.35", "1.0",
            "--train-interpolation", "bilinear", "--color-jitter", "0", "--smoothing", "0",
            "--output", str(bench.workdir / "timm")]  # fmt: skip
    env = {**bench.env, "PYTHONPATH": timm["pythonpath"]}
    cmd = [sys.executable, timm["train"], *args]
    print(f"  timm: {' '.join(cmd)}", flush=True)
    result = subprocess.run(cmd, cwd=bench.workdir, env=env, capture_output=True, text=True, timeout=1800)
    (bench.workdir / "timm.log").write_text(result.stdout + result.stderr)
    times = [float(m.group(4)) for m in TIMM_STEP.finditer(result.stdout + result.stderr)][warmup:steps]
    out = {"command": "python train.py " + " ".join(args), "log": str(bench.workdir / "timm.log")}
    if result.returncode != 0 or not times:
        tail = (result.stderr or result.stdout).strip().splitlines()
        return {**out, "error": tail[-1] if tail else f"no step times (exit {result.returncode})"}
    return {**out, "images_per_sec": R50_BATCH * len(times) / sum(times), "measured_steps": len(times)}


def _figures(run: dict) -> dict:
    return gpu_rows.figures(run)


def machine() -> dict:
    return {
        "date": dt.datetime.now().strftime("%Y-%m-%d %H:%M"),
        "host": platform.node(),
        "cpu_count": available_cpus(),
        "cpu": platform.processor() or platform.machine(),
        "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none",
        "torch": torch.__version__,
        "torchvision": torchvision.__version__,
        "python": platform.python_version(),
    }


SECTIONS = ("overhead", "modes", "workers", "breakdown", "checkpoint", "gpu-ceilings", "gpu-jpeg", "storage")
SECTIONS += ("decode-cpu", "resize-kernels")  # benchmarks/kernels.py
SECTIONS += ("augment-loaders", "recipe-cost")  # benchmarks/recipes.py
SECTIONS += ("threads",)  # benchmarks/threads_train.py
SECTIONS += ("big-photos",)  # benchmarks/big_photos.py
SECTIONS += ("per-core",)  # benchmarks/per_core.py


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="few steps and one repeat: a smoke test, not figures")
    parser.add_argument("--only", help=f"comma-separated sections to run (default: all): {', '.join(SECTIONS)}")
    parser.add_argument(
        "--repeats",
        type=int,
        help="interleaved runs each: overhead and per-core 5, checkpoint, threads and big-photos 3; quick: 1",
    )
    parser.add_argument("--workdir", type=Path, help="datasets and run directories (default: a temporary dir)")
    parser.add_argument("--json", type=Path, help="results file (default: benchmarks/results/<date>.json)")
    parser.add_argument("--markdown", type=Path, help="file to append the report to (default: BENCHMARKS.md)")
    parser.add_argument("--timm-train", help="timm's train.py: gpu-jpeg also runs it on the same JPEG folder")
    parser.add_argument("--timm-pythonpath", default="", help="PYTHONPATH holding the timm package to use")
    args = parser.parse_args(argv)
    only = args.only.split(",") if args.only else list(SECTIONS)
    unknown = sorted(set(only) - set(SECTIONS))
    if unknown:
        parser.error(f"--only {','.join(unknown)} is not a section: accepted values are {', '.join(SECTIONS)}")
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="imgtrain-bench-"))
    bench = Bench(workdir, args.quick)
    steps, warmup = (12, 2) if args.quick else (60, 10)
    # overhead: 200 steps, so the measured part (~20 s on 2 CPUs) holds the monitor's slow samples at their cadence
    overhead_steps = 12 if args.quick else 200
    gpu_steps, gpu_warmup = (12, 2) if args.quick else (GPU_STEPS, GPU_WARMUP)
    repeats = args.repeats or (1 if args.quick else 5)
    report = {
        "machine": machine(),
        "command": " ".join(["python", "benchmarks/bench.py", *(argv if argv is not None else sys.argv[1:])]),
        "quick": args.quick,
        "sections": only,
    }
    print(f"benchmarking {', '.join(only)} in {workdir} ...", flush=True)
    if "overhead" in only:
        report["overhead"] = overhead(bench, repeats, overhead_steps, warmup)
    if "modes" in only:
        report["modes"] = modes(bench, steps)
    if "workers" in only:
        report["workers"] = workers(bench, steps)
    if "breakdown" in only:
        report["breakdown"] = stage_breakdown(bench, repeats, steps)
    if "checkpoint" in only:
        ckpt_steps = 12 if args.quick else (1500 if torch.cuda.is_available() else CPU_CKPT_STEPS)
        report["checkpoint"] = checkpoint_cost(bench, 1 if args.quick else (args.repeats or 3), ckpt_steps)
    if "gpu-ceilings" in only:
        report["gpu_ceilings"] = gpu_ceilings(bench, gpu_steps, gpu_warmup)
    if "gpu-jpeg" in only:
        timm = None
        if args.timm_train:  # absolute: timm runs in the work directory
            timm = {"train": str(Path(args.timm_train).resolve()), "pythonpath": args.timm_pythonpath}
        report["gpu_jpeg"] = gpu_jpeg(bench, gpu_steps, gpu_warmup, timm)
    if "storage" in only:
        report["storage"] = storage(bench, imagefolder_root(bench), repeats, steps)
    if "decode-cpu" in only:
        report["decode_cpu"] = kernels.decode_cpu(40 if args.quick else 400, 1 if args.quick else 5)
    if "resize-kernels" in only:
        report["resize_kernels"] = kernels.resize_kernels(*((1, 1) if args.quick else (5, 10)))
    if "augment-loaders" in only:
        report["augment_loaders"] = recipes.augment_loaders(bench, 1 if args.quick else repeats)
    if "recipe-cost" in only:
        report["recipe_cost"] = recipes.recipe_cost(bench, 1 if args.quick else (args.repeats or 3))
    if "threads" in only:
        report["threads"] = threads_train.threads(bench, 1 if args.quick else (args.repeats or 3))
    if "big-photos" in only:
        report["big_photos"] = big_photos.section(workdir, args.quick, args.repeats or 3)
    if "per-core" in only:
        report["per_core"] = per_core.section(workdir, args.quick, args.repeats or 5)
    stamp = dt.datetime.now().strftime("%Y-%m-%d-%H%M%S")
    json_path = args.json or ROOT / "benchmarks" / "results" / f"{stamp}.json"
    json_path.parent.mkdir(parents=True, exist_ok=True)
    json_path.write_text(json.dumps(report, indent=2) + "\n")
    from render import render  # benchmarks/render.py

    sections = [*threads_train.render(report), *big_photos.render(report), *per_core.render(report)]
    text = render(report, json_path) + "\n".join(sections)
    markdown_path = args.markdown or ROOT / "BENCHMARKS.md"
    with open(markdown_path, "a") as f:
        f.write(text)
    print(text)
    print(f"results: {json_path}; report appended to {markdown_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
