"""(threads) The training path with each loader engine: `python train.py` with data.engine=dataloader (worker
processes) against data.engine=threads (loader threads in the training process, torchdata.nodes) at equal
data.num_workers, in interleaved rounds (bench.py runs it as `--only threads`).

benchmarks/threads/ compares the engines' loaders alone, outside train.py; this section runs the whole run as a
user does: the training loop, its monitor and the loader share one process with threads, and the loop's own
Python work competes with the loader threads for the GIL. Settings: photo-like JPEGs of 500x375 (a quarter
375x500; recipes.photo_folder) read by dataset=imagefolder with 224-px crops, dataset.augment=rrc_flip and
trivialaugment; `shapes` at 32 px. Each at 1 and 2 workers, in mode=train and mode=loader (the loader alone, in
the same process as train.py runs it), on the CPU, several epochs, so that epoch starts fall inside the measured
windows. The model is `tiny_cnn` below: a patchify stem and a linear head, so that the loader, not the model,
sets the pace. In each round the engines of a setting run back to back (dataloader first in even rounds, threads
first in odd ones), so the ratio threads/dataloader is taken round by round; every figure is metrics.json's.
"""

from __future__ import annotations

import os
import statistics
from pathlib import Path

from recipes import photo_folder  # benchmarks/recipes.py: the 500x375 JPEG folder of augment-loaders
from torch import nn

from imgtrain.data.shapes import ensure_shapes
from imgtrain.host import optional
from imgtrain.host.cpus import available_cpus

HERE = Path(__file__).resolve().parent
ENGINES = ("dataloader", "threads")
MODES = ("train", "loader")
SETTINGS = (("photos", "rrc_flip"), ("photos", "trivialaugment"), ("shapes", "rrc_flip"))  # (dataset, augment)
# Per dataset: files, batch, epochs, steps per logging window; the first window is warm-up. Photos: 1,280 files
# in 20 steps of 64 an epoch, 3 epochs: 11 steady windows of 5 steps, 2 of them an epoch's first. Shapes: 5,000
# files in 78 steps of 64, windows of 13 steps: 6 an epoch.
FULL = {
    "photos": {"per_class": 128, "size": (500, 375), "crop": 224, "batch": 64, "epochs": 3, "window": 5},
    "shapes": {"train": 5000, "val": 256, "crop": 32, "batch": 64, "epochs": 3, "window": 13},
    "workers": (1, 2),
    "settings": SETTINGS,
}
QUICK = {  # a smoke test: one worker, no trivialaugment, 5 and 4 steps an epoch, 2 epochs
    "photos": {"per_class": 4, "size": (160, 120), "crop": 64, "batch": 8, "epochs": 2, "window": 2},
    "shapes": {"train": 64, "val": 16, "crop": 32, "batch": 16, "epochs": 2, "window": 2},
    "workers": (1,),
    "settings": (SETTINGS[0], SETTINGS[2]),
}
SKIPPED = "not measured: data.engine=threads needs torchdata, which cannot be imported here: "
SKIPPED += optional.install_hint(optional.ENGINES["torchdata"])


def tiny_cnn(num_classes: int, **torchvision_keys: object) -> nn.Module:
    """The section's model (model._target_=threads_train.tiny_cnn): a 4x4 stride-4 stem has 1/16 of the positions
    of a stride-1 convolution, so a step at 224 px costs little next to decoding its batch. `torchvision_keys`:
    model=resnet18's other keys, unused."""
    return nn.Sequential(nn.Conv2d(3, 16, 4, stride=4), nn.BatchNorm2d(16), nn.ReLU(), nn.AdaptiveAvgPool2d(1),
                         nn.Flatten(), nn.Linear(16, num_classes))  # fmt: skip


def datasets(bench, sizes: dict) -> dict[str, list[str]]:
    """Each dataset's train.py overrides, its files generated here once, before any measured run."""
    photos, shapes = sizes["photos"], sizes["shapes"]
    root = photo_folder(bench.workdir, photos["per_class"], photos["size"])
    # dataset=shapes reads ${data_dir}/shapes (IMGTRAIN_DATA_DIR: the workdir's data/), generated at this key
    ensure_shapes(
        str(bench.workdir / "data" / "shapes"), shapes["crop"], shapes["train"], shapes["val"], 0, available_cpus()
    )
    return {
        "photos": ["dataset=imagefolder", f"dataset.root={root}", f"dataset.image_size={photos['crop']}"],
        "shapes": [
            "dataset=shapes",
            f"dataset.image_size={shapes['crop']}",
            f"dataset.num_train={shapes['train']}",
            f"dataset.num_val={shapes['val']}",
        ],
    }


def _common(size: dict, steps_per_epoch: int) -> list[str]:
    """The run's length and windows: every epoch of the dataset, the first window left out."""
    epochs, window = size["epochs"], size["window"]
    return [
        "model._target_=threads_train.tiny_cnn",
        "system.device=cpu",
        f"data.batch_size={size['batch']}",
        f"train.epochs={epochs}",
        f"train.max_steps={epochs * steps_per_epoch}",
        f"metrics.log_every_n_steps={window}",
        f"metrics.skip_first_steps={window}",
        "metrics.compute_probe=false",  # the probe times the model alone: seconds per run that measure nothing here
    ]


def threads(bench, rounds: int) -> dict:
    """Every setting, worker count, mode and engine, `rounds` interleaved rounds; per row the spreads over rounds
    and, for threads, its ratio to the same round's dataloader run."""
    if optional.missing("torchdata.nodes"):
        print(f"  threads: {SKIPPED}", flush=True)
        return {"note": SKIPPED, "rows": []}
    sizes = QUICK if bench.quick else FULL
    overrides = datasets(bench, sizes)
    files = {"photos": 10 * sizes["photos"]["per_class"], "shapes": sizes["shapes"]["train"]}
    common = {name: _common(sizes[name], files[name] // sizes[name]["batch"]) for name in files}
    # train.py imports the model by _target_: this folder on its path (under -S too: PYTHONPATH still applies)
    env = {"PYTHONPATH": os.pathsep.join(p for p in (str(HERE), os.environ.get("PYTHONPATH")) if p)}
    keys = [(s, w, m) for s in sizes["settings"] for w in sizes["workers"] for m in MODES]
    runs: dict[tuple, dict[str, list[dict]]] = {key: {engine: [] for engine in ENGINES} for key in keys}
    load = [os.getloadavg()[0]]  # this machine's other work: the rounds are interleaved so that it hits both
    for round_ in range(rounds):
        for (dataset, policy), workers, mode in keys:
            for engine in ENGINES if round_ % 2 == 0 else reversed(ENGINES):
                args = [*overrides[dataset], f"dataset.augment={policy}", *common[dataset], f"mode={mode}"]
                args += [f"data.engine={engine}", f"data.num_workers={workers}"]
                runs[((dataset, policy), workers, mode)][engine].append(bench.train(*args, env=env))
    return {
        "sizes": {name: {k: v for k, v in sizes[name].items()} for name in files},
        "files": files,
        "rounds": rounds,
        "load_average_1min": [*load, os.getloadavg()[0]],  # before and after
        "rows": [_row(key, engine, runs[key]) for key in keys for engine in ENGINES],
    }


def _spread(values: list) -> dict | None:
    values = [v for v in values if v is not None]
    if not values:
        return None
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "runs": values}


def _stall(run: dict) -> float | None:
    """A run's epoch-start stall: the median over its epochs after the first (metrics.json's epoch_start_cost_s)."""
    costs = run.get("epoch_start_cost_s") or []
    return statistics.median(costs) if costs else None


def _first_batch(run: dict) -> float | None:
    """The time to the first batch: the first epoch's epoch_first_batch_s (workers or threads started)."""
    return (run.get("epoch_first_batch_s") or [None])[0]


def _row(key: tuple, engine: str, done: dict[str, list[dict]]) -> dict:
    (dataset, policy), workers, mode = key
    mine = done[engine]
    rates = [run.get("images_per_sec") for run in mine]
    base = [run.get("images_per_sec") for run in done["dataloader"]]
    ratios = [a / b for a, b in zip(rates, base, strict=True) if a and b] if engine != "dataloader" else []
    return {
        "dataset": dataset,
        "policy": policy,
        "workers": workers,
        "mode": mode,
        "engine": engine,
        "images_per_sec": _spread(rates),
        "ratio_to_dataloader": _spread(ratios),  # round by round
        "pss_peak_gb": _spread([run.get("pss_peak_gb") for run in mine]),
        "epoch_start_stall_s": _spread([_stall(run) for run in mine]),
        "first_batch_s": _spread([_first_batch(run) for run in mine]),
        "later_first_batch_s": _spread([s for run in mine for s in (run.get("epoch_first_batch_s") or [])[1:]]),
        "data_wait_frac": _spread([run.get("data_wait_frac") for run in mine]),
        "command": mine[0].get("command") if mine else None,
        "errors": sorted({run["error"] for run in mine if "error" in run}),
    }


# ----------------------------------------------------------------------------- the report
def _cell(s: dict | None, fmt: str) -> str:
    return f"{s['median']:{fmt}} ({s['min']:{fmt}}-{s['max']:{fmt}})" if s else "—"


def render(report: dict) -> list[str]:
    """The section's markdown, when the report holds it."""
    if "threads" not in report:
        return []
    result = report["threads"]
    lines = ["", "### Loader engines in train.py: data.engine=dataloader against threads (CPU)", ""]
    if not result["rows"]:
        return [*lines, result.get("note", "not measured"), ""]
    photos, shapes = result["sizes"]["photos"], result["sizes"]["shapes"]
    width, height = photos["size"]
    loads = " and ".join(f"{v:.2f}" for v in result["load_average_1min"])
    lines.append(
        f"`tiny_cnn` (benchmarks/threads_train.py) on the CPU; photos: {result['files']['photos']} JPEGs of "
        f"{width}x{height} (a quarter {height}x{width}), {photos['crop']}-px crops, batch {photos['batch']}, "
        f"{photos['epochs']} epochs; shapes: {result['files']['shapes']} images at 32 px, batch {shapes['batch']}, "
        f"{shapes['epochs']} epochs; the first logging window left out. {result['rounds']} interleaved rounds; "
        f"medians over rounds (min-max). Stall: epoch_start_cost_s, the median over a run's later epochs; first "
        f"batch: the first epoch's epoch_first_batch_s. 1-minute load average before and after: {loads}."
    )
    lines += [
        "",
        "| dataset | policy | mode | N | engine | images/s | threads / dataloader, per round | PSS peak GB "
        "| epoch-start stall s | first batch s | data wait | errors |",
        "| --- | --- | --- | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | --- |",
    ]
    for row in result["rows"]:
        ratio = _cell(row["ratio_to_dataloader"], ".2f") + "x" if row["ratio_to_dataloader"] else "—"
        cells = [row["dataset"], row["policy"], row["mode"], str(row["workers"]), row["engine"]]
        cells += [_cell(row["images_per_sec"], ",.0f"), ratio, _cell(row["pss_peak_gb"], ".2f")]
        cells += [_cell(row["epoch_start_stall_s"], ".3f"), _cell(row["first_batch_s"], ".2f")]
        cells += [_cell(row["data_wait_frac"], ".0%"), "; ".join(row["errors"])]
        lines.append("| " + " | ".join(cells) + " |")
    return [*lines, ""]
