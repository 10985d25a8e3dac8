"""The benchmark harness: `make bench` (full) or `make bench-quick` (the smoke test CI runs).

In one invocation, on this machine:
  (a) instrumentation overhead: train.py against benchmarks/bare_loop.py, median of N interleaved runs each;
  (b) the three modes (loader, compute, train) for the synthetic, shapes and imagefolder datasets, plus the
      device-resident train path;
  (c) loader throughput (mode=loader, shapes) as data.num_workers grows to the CPU count;
  (d) the GPU targets, run only when CUDA is available, otherwise listed as "not measured".
Every figure comes from a real run's metrics.json (or the bare loop's output); nothing is estimated.
Results go to a JSON file and, as a dated markdown section, to BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
import torchvision

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
from imgtrain.loader import available_cpus  # noqa: E402
from imgtrain.shapes import ensure_shapes  # noqa: E402

NOT_MEASURED = "not measured: no CUDA device on this machine"


class Bench:
    """Runs train.py and the bare loop as subprocesses and collects their figures."""

    def __init__(self, workdir: Path, quick: bool) -> None:
        self.workdir, self.quick = workdir, quick
        self.env = {**os.environ, "IMGTRAIN_DATA_DIR": str(workdir / "data"), "PYTHONUNBUFFERED": "1"}
        self.runs = 0

    def train(self, *overrides: str, timeout: float = 1800) -> dict:
        """One train.py run; its metrics.json plus the command that produced it."""
        self.runs += 1
        run_dir = self.workdir / "runs" / f"{self.runs:03d}"
        args = [*overrides, "trainer.save_checkpoints=false", "trainer.progress_bar=false"]
        cmd = [sys.executable, "train.py", *args, f"hydra.run.dir={run_dir}"]
        result = subprocess.run(cmd, cwd=ROOT, env=self.env, capture_output=True, text=True, timeout=timeout)
        if result.returncode != 0:
            tail = (result.stderr or result.stdout).strip().splitlines()[-1:]
            return {"command": _shown(args), "error": tail[0] if tail else f"exit {result.returncode}"}
        metrics = json.loads((run_dir / "metrics.json").read_text())
        return {"command": _shown(args), **metrics}

    def bare(self, steps: int, warmup: int) -> dict:
        cmd = [sys.executable, "benchmarks/bare_loop.py", f"--data-dir={self.workdir / 'data'}"]
        cmd += [f"--steps={steps}", f"--warmup={warmup}"]
        result = subprocess.run(cmd, cwd=ROOT, env=self.env, capture_output=True, text=True, timeout=1800)
        if result.returncode != 0:
            return {"error": result.stderr.strip().splitlines()[-1]}
        return json.loads(result.stdout.strip().splitlines()[-1])


def _shown(args: list[str]) -> str:
    return "python train.py " + " ".join(shlex.quote(a) for a in args if not a.startswith("trainer.progress_bar"))


def overhead(bench: Bench, repeats: int, steps: int, warmup: int) -> dict:
    """(a) train.py's steady-state images/s against the bare loop's, interleaved, median of `repeats` each."""
    ours, bare = [], []
    for i in range(repeats):
        order = ("ours", "bare") if i % 2 == 0 else ("bare", "ours")  # alternate, so drift hits both
        for which in order:
            if which == "ours":
                run = bench.train(f"trainer.max_steps={steps}", f"trainer.warmup_steps={warmup}")
                ours.append(run.get("images_per_sec"))
            else:
                bare.append(bench.bare(steps, warmup).get("images_per_sec"))
    valid_ours, valid_bare = [v for v in ours if v], [v for v in bare if v]
    result = {"train_py": ours, "bare_loop": bare, "steps": steps, "warmup": warmup}
    if valid_ours and valid_bare:
        result["train_py_median"] = statistics.median(valid_ours)
        result["bare_loop_median"] = statistics.median(valid_bare)
        result["overhead"] = 1 - result["train_py_median"] / result["bare_loop_median"]
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
            run = bench.train(*args, f"mode={mode}", f"trainer.max_steps={steps}")
            rows.append({"dataset": name, "mode": mode, **_figures(run)})
    run = bench.train(*datasets["shapes"], "data.device_resident=true", f"trainer.max_steps={steps}")
    rows.append({"dataset": "shapes", "mode": "train, data.device_resident=true", **_figures(run)})
    return rows


def workers(bench: Bench, steps: int) -> list[dict]:
    """(c) mode=loader on shapes, num_workers from 0 to the CPU count."""
    counts = sorted({0, 1, 2, *range(0, available_cpus() + 1, max(1, available_cpus() // 4))})
    rows = []
    for count in [c for c in counts if c <= available_cpus()]:
        run = bench.train("mode=loader", f"data.num_workers={count}", f"trainer.max_steps={steps}")
        rows.append({"num_workers": count, **_figures(run)})
    return rows


GPU_TARGETS = [
    ("ResNet-18 CIFAR-style 32 px bf16: compute ceiling (target >= 40,000 img/s)",
     ["mode=compute", "model=resnet18_cifar", "dataset=synthetic", "dataset.image_size=32",
      "data.batch_size=512", "trainer.precision=bf16"]),
    ("ResNet-18 CIFAR-style 32 px bf16: device-resident train (target >= 90% of the ceiling, GPU util >= 95%)",
     ["model=resnet18_cifar", "dataset=synthetic", "dataset.image_size=32", "dataset.num_train=50000",
      "data.batch_size=512", "trainer.precision=bf16", "data.device_resident=true"]),
    ("ResNet-18 CIFAR-style 32 px bf16: DataLoader path, shapes JPEGs, 16 workers (target >= 80% of the ceiling)",
     ["model=resnet18_cifar", "dataset.num_train=50000", "data.batch_size=512", "trainer.precision=bf16",
      "data.num_workers=16"]),
    ("ResNet-50 224 px bf16, synthetic (target >= 3,000 img/s)",
     ["model=resnet50", "dataset=synthetic", "dataset.image_size=224", "data.batch_size=256",
      "trainer.precision=bf16"]),
    ("ResNet-50 224 px bf16, JPEG imagefolder, 16 workers, CPU decode",
     ["model=resnet50", "dataset=imagefolder", "dataset.root={jpeg224}", "data.batch_size=256",
      "trainer.precision=bf16", "data.num_workers=16", "dataset.decode=cpu"]),
    ("ResNet-50 224 px bf16, JPEG imagefolder, 16 workers, GPU decode (nvJPEG)",
     ["model=resnet50", "dataset=imagefolder", "dataset.root={jpeg224}", "data.batch_size=256",
      "trainer.precision=bf16", "data.num_workers=16", "dataset.decode=cuda"]),
]  # fmt: skip


def gpu(bench: Bench, steps: int) -> list[dict]:
    """(d) the GPU targets: measured when CUDA is available, otherwise listed as not measured."""
    if not torch.cuda.is_available():
        return [{"target": name, "note": NOT_MEASURED} for name, _ in GPU_TARGETS]
    return [
        {"target": name, **_figures(bench.train(*args, f"trainer.max_steps={steps}"))} for name, args in GPU_TARGETS
    ]


def _figures(run: dict) -> dict:
    keys = ("images_per_sec", "data_wait_frac", "gpu_util_mean", "cpu_pct_mean", "rss_peak_gb", "command", "error")
    return {key: run.get(key) for key in keys if key in run}


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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="few steps and one repeat: a smoke test, not figures")
    parser.add_argument("--repeats", type=int, help="interleaved runs each for the overhead (default 5; quick 1)")
    parser.add_argument("--workdir", type=Path, help="datasets and run directories (default: a temporary dir)")
    parser.add_argument("--json", type=Path, help="results file (default: benchmarks/results/<date>.json)")
    parser.add_argument("--markdown", type=Path, help="file to append the report to (default: BENCHMARKS.md)")
    args = parser.parse_args(argv)
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="imgtrain-bench-"))
    bench = Bench(workdir, args.quick)
    steps, warmup = (12, 2) if args.quick else (60, 10)
    repeats = args.repeats or (1 if args.quick else 5)
    report = {
        "machine": machine(),
        "command": " ".join(["python", "benchmarks/bench.py", *(argv if argv is not None else sys.argv[1:])]),
        "quick": args.quick,
    }
    print(f"benchmarking in {workdir} ...", flush=True)
    report["overhead"] = overhead(bench, repeats, steps, warmup)
    report["modes"] = modes(bench, steps)
    report["workers"] = workers(bench, steps)
    report["gpu"] = gpu(bench, 200 if not args.quick else steps)
    stamp = dt.datetime.now().strftime("%Y-%m-%d-%H%M%S")
    json_path = args.json or ROOT / "benchmarks" / "results" / f"{stamp}.json"
    json_path.parent.mkdir(parents=True, exist_ok=True)
    json_path.write_text(json.dumps(report, indent=2) + "\n")
    from render import render  # benchmarks/render.py

    text = render(report, json_path)
    markdown_path = args.markdown or ROOT / "BENCHMARKS.md"
    with open(markdown_path, "a") as f:
        f.write(text)
    print(text)
    print(f"results: {json_path}; report appended to {markdown_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
