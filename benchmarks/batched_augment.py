"""Issue 22 (crop, resize and flip per batch instead of per sample): the input pipeline of two source trees, the
baseline commit and the working tree, measured in one invocation, interleaved.

    git -C /work/main worktree add --detach /tmp/base-86de38f 86de38f   # once
    python benchmarks/batched_augment.py --base /tmp/base-86de38f --new /work/main \\
        --repeats 5 --steps 2000 --imagefolder-steps 250 --workdir /tmp/batched-augment

What runs: `python train.py mode=loader ...` (the DataLoader and the host copy, no model) on the CPU, as a
subprocess of each tree's own train.py with PYTHONPATH=<tree>/src, so no imgtrain module is imported here.
Three cases:

- shapes32_w0: dataset=shapes at 32 px, data.num_workers=0
- shapes32_w1: dataset=shapes at 32 px, data.num_workers=1
- imagenet224_w1: dataset=imagefolder over DIR/data/imagenet-like (10 classes, 600 train + 100 val JPEGs of
  500x375, quality 90, about 100 KB each, generated once here with numpy and PIL), RandomResizedCrop to 224,
  data.num_workers=1

Order: every repeat runs every case once per tree, back to back; the tree that goes first alternates from repeat
to repeat (base, new | new, base | ...) so a drift of the machine's speed falls on both. Before the measured
repeats, one short untimed run per tree and dataset fills the page cache and the trees' __pycache__ and
generates the shapes dataset (both trees read the same one: IMGTRAIN_DATA_DIR=DIR/data).

Per run, from its metrics.json (steady state: the windows after metrics.skip_first_steps):
- images/s: `images_per_sec`
- busy cores of loading: `pipeline.worker_busy_cores` (both trees): the wall seconds the loading processes spent
  in the Dataset's __getitem__ and collate, over the steady seconds (with num_workers=0 the training process's
  own loading). 21a2e23's per-batch crop/resize/flip (GuardedSamples.__getitems__) is added to its samples'
  totals, so it is in; work done in the training loop after the batch arrives would not be.
- process CPU cores: `proc_cpu_pct_mean` / 100 x `cpu_count` (both trees): the CPU of the training process and
  its workers, sampled by the resource monitor over the steady state; it counts work wherever it runs, but also
  what is not loading (the monitor, torch's threads): 1.7-1.9 cores at num_workers=0, where loading is one thread.
Figures: images/s per busy core and images/s per process CPU core. Per case and tree: the median and min-max
over the repeats; per case: the ratio new/base of the medians and the per-pair ratios (each repeat's new run
over its base run, run back to back): median and min-max. Targets (issue 22): shapes at 0 and 1 worker,
images/s per busy core >= 1.5x; imagenet224_w1, images/s >= 0.95x.

Writes DIR/results-<time>.json (every run's figures and the summary) and prints a markdown table. Each run's
Hydra directory is DIR/runs/<time>/<case>/<tree>-r<repeat> with its console output in run.log there.

Duration on the 2-core development machine, from a --repeats 1 run at these step counts (21a2e23 against
86de38f): start-up about 4 s per run; runs of 11-17 s (new, shapes), 23-29 s (base, shapes) and 30-32 s
(imagenet224_w1, both); one repeat (6 runs) about 2.4 min, the warm-up (4 short runs) about 25 s, generating the
folder (once, 70 MB) about 17 s. `--repeats 5`: about 13 minutes. The shapes runs have ~36 steady windows (an
epoch's end closes one too), imagenet224_w1 ~34. Quick check that both trees run (about 70 s):
`--repeats 1 --steps 80 --imagefolder-steps 38`.

Overrides: old trees (conf/trainer/ present, 86de38f) take trainer.max_steps, trainer.epochs, trainer.warmup_steps,
trainer.log_every_n_steps, trainer.save_checkpoints=false, trainer.device=cpu, trainer.progress_bar=false,
trainer.resume=none; newer ones train.max_steps, train.epochs, metrics.skip_first_steps,
metrics.log_every_n_steps, checkpoint.save=false, system.device=cpu, metrics.progress_bar=false,
checkpoint.resume=none. Dataset and data keys are the same in both.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
from PIL import Image

CASES = {  # name: (dataset, workers)
    "shapes32_w0": ("shapes", 0),
    "shapes32_w1": ("shapes", 1),
    "imagenet224_w1": ("imagenet", 1),
}
TARGETS = {  # name: (figure whose ratio the issue sets, the least ratio new/base)
    "shapes32_w0": ("per_busy_core", 1.5),
    "shapes32_w1": ("per_busy_core", 1.5),
    "imagenet224_w1": ("images_per_sec", 0.95),
}
FIGURES = ("images_per_sec", "per_busy_core", "per_proc_core")
MIN_WINDOWS = 6  # steady windows per run: the new tree's images_per_sec_interval needs 6
CLASSES = 10
NOISE_SIGMA = 20.0  # levels: sets the file size (about 100 KB at quality 90 and 500x375)


# ----------------------------------------------------------------------------- the ImageNet-sized folder
def make_imagenet_like(root: Path, train: int, val: int, size: tuple[int, int] = (500, 375), seed: int = 0) -> None:
    """root/{train,val}/<class>/*.jpg: smooth colour fields, a few drawn shapes and noise, quality 90 (about
    100 KB at 500x375, near ImageNet's average). Written once: a finished folder has root/.complete."""
    if (root / ".complete").exists():
        return
    width, height = size
    rng = np.random.default_rng(seed)
    started = time.perf_counter()
    for split, count in (("train", train), ("val", val)):
        for index in range(count):
            label = index % CLASSES
            folder = root / split / f"class{label:02d}"
            folder.mkdir(parents=True, exist_ok=True)
            picture = _texture(rng, width, height)
            picture.save(folder / f"{index:06d}.jpg", "JPEG", quality=90)
    (root / ".complete").write_text("")
    sizes = [path.stat().st_size for path in root.glob("*/*/*.jpg")]
    print(
        f"generated {len(sizes)} JPEGs of {width}x{height} under {root} in {time.perf_counter() - started:.1f} s, "
        f"mean {statistics.mean(sizes) / 1000:.1f} KB",
        flush=True,
    )


def _texture(rng: np.random.Generator, width: int, height: int) -> Image.Image:
    """Low- and mid-frequency colour noise (upsampled), soft-edged discs, then per-pixel noise."""
    coarse = Image.fromarray(rng.integers(0, 256, (4, 5, 3), dtype=np.uint8)).resize((width, height), Image.BICUBIC)
    middle = Image.fromarray(rng.integers(0, 256, (24, 32, 3), dtype=np.uint8)).resize((width, height), Image.BICUBIC)
    pixels = 0.6 * np.asarray(coarse, np.float32) + 0.4 * np.asarray(middle, np.float32)
    y, x = np.mgrid[0:height, 0:width].astype(np.float32)
    for _ in range(int(rng.integers(3, 8))):
        cx, cy, radius = rng.uniform(0, width), rng.uniform(0, height), rng.uniform(20, 120)
        inside = np.clip((radius - np.hypot(x - cx, y - cy)) / 4.0, 0.0, 1.0)[..., None]
        pixels = pixels * (1 - inside) + rng.uniform(0, 255, 3).astype(np.float32) * inside
    pixels += rng.normal(0.0, NOISE_SIGMA, pixels.shape).astype(np.float32)
    return Image.fromarray(np.clip(pixels, 0, 255).astype(np.uint8), "RGB")


# ----------------------------------------------------------------------------- one run of train.py
def is_old_tree(tree: Path) -> bool:
    """86de38f and before: every run setting under `trainer.*` (conf/trainer/); later: train/metrics/system/..."""
    return (tree / "conf" / "trainer").is_dir()


def overrides(tree: Path, case: str, steps: int, skip: int, log_every: int, imagenet_root: Path) -> list[str]:
    """The train.py overrides of one case for one tree."""
    dataset, workers = CASES[case]
    if is_old_tree(tree):
        run = [f"trainer.max_steps={steps}", "trainer.epochs=1000", f"trainer.warmup_steps={skip}"]
        run += [f"trainer.log_every_n_steps={log_every}", "trainer.save_checkpoints=false", "trainer.device=cpu"]
        run += ["trainer.progress_bar=false", "trainer.resume=none"]
    else:
        run = [f"train.max_steps={steps}", "train.epochs=1000", f"metrics.skip_first_steps={skip}"]
        run += [f"metrics.log_every_n_steps={log_every}", "checkpoint.save=false", "system.device=cpu"]
        run += ["metrics.progress_bar=false", "checkpoint.resume=none"]
    if dataset == "shapes":
        data = ["dataset=shapes", "dataset.image_size=32"]
    else:
        data = ["dataset=imagefolder", f"dataset.root={imagenet_root}", "dataset.image_size=224"]
    return ["mode=loader", *data, f"data.num_workers={workers}", *run]


def run_train(tree: Path, args: list[str], run_dir: Path, data_dir: Path, timeout: float) -> dict:
    """`python train.py <args>` from `tree` with its own src/ first on the path; the run's metrics.json."""
    env = dict(os.environ, IMGTRAIN_DATA_DIR=str(data_dir), PYTHONPATH=f"{tree / 'src'}")
    command = [sys.executable, str(tree / "train.py"), *args, f"hydra.run.dir={run_dir}"]
    run_dir.parent.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    done = subprocess.run(command, cwd=tree, env=env, capture_output=True, text=True, timeout=timeout)
    seconds = time.perf_counter() - started
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "run.log").write_text(done.stdout + done.stderr)
    if done.returncode != 0:
        tail = "\n".join((done.stdout + done.stderr).splitlines()[-25:])
        raise SystemExit(f"failed (exit {done.returncode}): {' '.join(command)}\n{tail}")
    metrics = json.loads((run_dir / "metrics.json").read_text())
    metrics["_wall_s"] = seconds
    return metrics


def figures(metrics: dict) -> dict:
    """The figures this benchmark compares, from one metrics.json."""
    rate = metrics.get("images_per_sec")
    busy = (metrics.get("pipeline") or {}).get("worker_busy_cores")
    proc_pct, cpus = metrics.get("proc_cpu_pct_mean"), metrics.get("cpu_count")
    proc = proc_pct / 100.0 * cpus if proc_pct is not None and cpus else None
    return {
        "images_per_sec": rate,
        "worker_busy_cores": busy,
        "proc_cpu_cores": proc,
        "per_busy_core": rate / busy if rate and busy else None,
        "per_proc_core": rate / proc if rate and proc else None,
        "windows": len(metrics.get("images_per_sec_windows") or []),
        "images_per_sec_interval": metrics.get("images_per_sec_interval"),  # new trees only
        "data_wait_frac": metrics.get("data_wait_frac"),
        "stage_ms_per_image": (metrics.get("pipeline") or {}).get("stage_ms_per_image"),
        "steps": metrics.get("steps"),
        "wall_s": round(metrics["_wall_s"], 1),
    }


def tree_revision(tree: Path) -> str:
    """The tree's commit, with '+changes' when what train.py runs (src/, conf/, train.py) differs from it."""
    head = subprocess.run(["git", "-C", str(tree), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    status = ["git", "-C", str(tree), "status", "--porcelain", "--", "src", "conf", "train.py"]
    dirty = subprocess.run(status, capture_output=True, text=True)
    return head.stdout.strip() + ("+changes" if dirty.stdout.strip() else "")


# ----------------------------------------------------------------------------- statistics and the table
def spread(values: list[float | None]) -> dict | None:
    """Median and min-max of the values that were measured."""
    values = [v for v in values if v is not None]
    if not values:
        return None
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "n": len(values)}


def summarize(runs: list[dict]) -> dict:
    """Per case: each tree's spreads, the ratio of the medians and the per-pair ratios' spread."""
    result = {}
    for case in CASES:
        mine = [r for r in runs if r["case"] == case]
        trees = {t: {f: spread([r[f] for r in mine if r["tree"] == t]) for f in FIGURES} for t in ("base", "new")}
        ratios = {}
        for figure in FIGURES:
            base, new = trees["base"][figure], trees["new"][figure]
            pairs = []
            for repeat in sorted({r["repeat"] for r in mine}):
                pair = {r["tree"]: r[figure] for r in mine if r["repeat"] == repeat}
                if pair.get("base") and pair.get("new"):
                    pairs.append(pair["new"] / pair["base"])
            ratios[figure] = {
                "of_medians": new["median"] / base["median"] if base and new else None,
                "per_pair": spread(pairs),
            }
        figure, least = TARGETS[case]
        ratio = ratios[figure]["of_medians"]
        target = {"figure": figure, "least": least, "met": None if ratio is None else ratio >= least}
        result[case] = {"trees": trees, "ratios": ratios, "target": target}
    return result


def _fmt(cell: dict | None, digits: int = 0) -> str:
    if cell is None:
        return "n/a"
    return f"{cell['median']:,.{digits}f} ({cell['min']:,.{digits}f}-{cell['max']:,.{digits}f})"


def table(summary: dict) -> str:
    """Markdown: per case and tree the medians (min-max); per case the ratios new/base."""
    lines = [
        "| case | tree | images/s | images/s per busy core | images/s per process CPU core |",
        "|---|---|---|---|---|",
    ]
    for case, row in summary.items():
        for tree in ("base", "new"):
            cells = [_fmt(row["trees"][tree][f]) for f in FIGURES]
            lines.append(f"| {case} | {tree} | " + " | ".join(cells) + " |")
    lines += [
        "",
        "Ratio new/base: of the medians; per pair (run back to back) median (min-max).",
        "",
        "| case | images/s | per busy core | per process CPU core | target | met |",
        "|---|---|---|---|---|---|",
    ]
    for case, row in summary.items():
        cells = []
        for figure in FIGURES:
            ratio = row["ratios"][figure]
            medians = "n/a" if ratio["of_medians"] is None else f"{ratio['of_medians']:.2f}x"
            cells.append(f"{medians}; pairs {_fmt(ratio['per_pair'], 2)}")
        target = row["target"]
        met = {None: "n/a", True: "yes", False: "no"}[target["met"]]
        lines.append(f"| {case} | " + " | ".join(cells) + f" | {target['figure']} >= {target['least']}x | {met} |")
    return "\n".join(lines)


# ----------------------------------------------------------------------------- main
def log_every_for(steps: int, skip: int) -> int:
    """metrics.log_every_n_steps for about 10 steady windows: MIN_WINDOWS and a margin (the window holding the
    last skipped step is not steady; an epoch's end also closes a window)."""
    log_every = (steps - skip) // (MIN_WINDOWS + 4)  # about 10 windows
    if log_every < 1:
        raise SystemExit(f"{steps} steps with {skip} skipped leave fewer than {MIN_WINDOWS} windows")
    return log_every


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base", type=Path, required=True, help="the baseline tree (a worktree of 86de38f)")
    parser.add_argument("--new", type=Path, required=True, help="the tree under test")
    parser.add_argument("--repeats", type=int, default=5, help="measured runs per case and tree")
    parser.add_argument("--steps", type=int, default=2000, help="train.max_steps of the shapes cases")
    parser.add_argument("--imagefolder-steps", type=int, default=250, help="train.max_steps of imagenet224_w1")
    parser.add_argument("--skip", type=int, default=10, help="steps left out of the steady state")
    parser.add_argument("--workdir", type=Path, required=True, help="data, run directories and results")
    parser.add_argument("--cases", default=",".join(CASES), help="comma-separated subset of " + ", ".join(CASES))
    parser.add_argument("--train-images", type=int, default=600, help="imagenet-like training JPEGs")
    parser.add_argument("--no-warmup", action="store_true", help="skip the untimed runs before the repeats")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds one run may take")
    args = parser.parse_args()

    cases = args.cases.split(",")
    unknown = set(cases) - set(CASES)
    if unknown:
        raise SystemExit(f"unknown cases {sorted(unknown)}; known: {', '.join(CASES)}")
    trees = {"base": args.base.resolve(), "new": args.new.resolve()}
    for tree in trees.values():
        if not (tree / "train.py").is_file():
            raise SystemExit(f"{tree} has no train.py")
    workdir = args.workdir.resolve()
    data_dir = workdir / "data"
    imagenet_root = data_dir / "imagenet-like"
    if any(CASES[c][0] == "imagenet" for c in cases):
        make_imagenet_like(imagenet_root, args.train_images, 100)
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    runs_dir = workdir / "runs" / stamp
    steps = {c: args.imagefolder_steps if CASES[c][0] == "imagenet" else args.steps for c in cases}
    revisions = {name: tree_revision(tree) for name, tree in trees.items()}
    print(f"base {trees['base']} ({revisions['base']}), new {trees['new']} ({revisions['new']})", flush=True)

    def one(name: str, case: str, label: str, n_steps: int) -> dict:
        tree = trees[name]
        skip = min(args.skip, n_steps - 1)
        argv = overrides(tree, case, n_steps, skip, log_every_for(n_steps, skip), imagenet_root)
        return run_train(tree, argv, runs_dir / case / f"{name}-{label}", data_dir, args.timeout)

    if not args.no_warmup:  # page cache, __pycache__, the shapes dataset: once per tree and dataset
        for dataset in dict.fromkeys(CASES[c][0] for c in cases):
            case = next(c for c in cases if CASES[c][0] == dataset)
            for name in trees:
                metrics = one(name, case, "warmup", args.skip + 20)
                print(f"warm-up {case} {name}: {metrics['_wall_s']:.1f} s", flush=True)

    runs = []
    for repeat in range(args.repeats):
        order = ("base", "new") if repeat % 2 == 0 else ("new", "base")
        for case in cases:
            for name in order:
                record = {"case": case, "tree": name, "repeat": repeat, "revision": revisions[name]}
                record |= figures(one(name, case, f"r{repeat}", steps[case]))
                runs.append(record)
                if record["windows"] < MIN_WINDOWS:
                    print(f"warning: {case} {name} r{repeat} has {record['windows']} steady windows", flush=True)
                print(
                    f"r{repeat} {case:15s} {name:4s} {record['images_per_sec'] or 0:9.1f} images/s, "
                    f"busy {record['worker_busy_cores'] or 0:.2f} cores, process {record['proc_cpu_cores'] or 0:.2f}"
                    f" cores, {record['windows']} windows, {record['wall_s']:.1f} s",
                    flush=True,
                )

    summary = summarize(runs)
    out = workdir / f"results-{stamp}.json"
    setup = {key: str(value) if isinstance(value, Path) else value for key, value in vars(args).items()}
    out.write_text(json.dumps({"args": setup, "revisions": revisions, "runs": runs, "summary": summary}, indent=1))
    print()
    print(table({case: summary[case] for case in cases}))
    print(f"\nevery run's figures: {out}")


if __name__ == "__main__":
    main()
