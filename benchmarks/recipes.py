"""Two sections of the harness for the training recipe's knobs (bench.py runs them):

augment-loaders  the training loader's images/s per worker with dataset.augment=rrc_flip, trivialaugment and
                 randaugment (n=2, m=9), against timm 1.0.28's loader with the same policy, on an ImageNet-like
                 JPEG folder (500x375 and 375x500 photo-like JPEGs), 224-px crops, batches of 32, one worker and
                 the CPU count. Each measurement is a process of its own (benchmarks/loader_child.py): ours builds
                 the loader train.py builds (hydra compose, validate, pipeline.build_data), timm's is its
                 create_loader as its train.py calls it (uint8 batches, as ours), run with timm's wheel from the
                 peer kit installed in a directory of its own (PYTHONPATH), so the venv's timm and 1.0.28 never
                 meet in one process. Interleaved rounds (ours first in even rounds, timm first in odd ones), the
                 ratio taken round by round; the stage ms per image our batches carry (Batch.times), and timm's
                 per image stages timed in its process on one thread;
recipe-cost      the cost per step of mixup/cutmix and of EMA: train.py runs on synthetic 32-px images with
                 ResNet-18 (on the device the machine has), baseline, mixup 0.2 + cutmix 1.0, EMA 0.999 every
                 step, and both, in interleaved rounds; step time is the median of the run's logging windows,
                 each variant's against the same round's baseline.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

import kernels  # benchmarks/kernels.py: make_jpegs
import torch
from loader_child import POLICIES, STAGES, TIMM_POLICY  # benchmarks/loader_child.py: one measurement

from imgtrain.host.cpus import available_cpus

ROOT = Path(__file__).resolve().parents[1]
TIMM_VERSION = "1.0.28"
PEER_WHEEL = ROOT.parent / "shared/peers/timm/timm-1.0.28-py3-none-any.whl"  # the peer kit: ../shared/peers/timm
# (files per class, photo size, crop, batch, measured batches); warm-up: 2 x workers + 1 batches
FULL, QUICK = (160, (500, 375), 224, 32, 40), (6, (160, 120), 64, 8, 2)


def _spread(values: list[float]) -> dict | None:
    if not values:
        return None
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "runs": values}


# ----------------------------------------------------------------------------- augment-loaders: the parent side
def photo_folder(workdir: Path, per_class: int, size: tuple[int, int]) -> Path:
    """root/train/<class>/*.jpg (and two files a class in val/): a random gradient plus noise at quality 90, each
    fourth one portrait, like ImageNet's mix; generated once in the workdir."""
    width, height = size
    root = workdir / "data" / f"photos-{width}x{height}-{per_class}"
    if (root / "done").exists():
        return root
    for c in range(10):
        for split, count in (("train", per_class), ("val", 2)):
            folder = root / split / f"class_{c}"
            folder.mkdir(parents=True, exist_ok=True)
            portrait = count // 4
            files = kernels.make_jpegs(count - portrait, width, height, seed=c)
            files += kernels.make_jpegs(portrait, height, width, seed=100 + c)
            for i, data in enumerate(files):
                (folder / f"{i:04d}.jpg").write_bytes(data.numpy().tobytes())
    (root / "done").write_text("")
    return root


def install_timm(workdir: Path) -> tuple[str | None, str]:
    """timm 1.0.28 from the peer kit's wheel in a directory of its own: (that directory, "") or (None, why not)."""
    wheel = Path(os.environ.get("IMGTRAIN_TIMM_WHEEL", PEER_WHEEL))
    target = workdir / f"timm-{TIMM_VERSION}"
    if (target / "timm" / "version.py").exists():
        return str(target), ""
    if not wheel.is_file():
        return None, f"not measured: no timm wheel at {wheel} (the environment's IMGTRAIN_TIMM_WHEEL names another)"
    cmd = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--target", str(target)]
    result = subprocess.run([*cmd, str(wheel)], capture_output=True, text=True)
    if result.returncode != 0:
        tail = (result.stderr or result.stdout).strip().splitlines()
        return None, f"not measured: pip could not install {wheel.name}: {tail[-1] if tail else result.returncode}"
    return str(target), ""


def _loader_run(bench, side: str, policy: str, workers: int, setup: dict) -> dict:
    """One measurement in a process of its own: its JSON line, or the error that ended it."""
    args = ["--side", side, "--root", str(setup["root"]), "--policy", policy, "--workers", str(workers)]
    args += ["--batch", str(setup["batch"]), "--size", str(setup["crop"]), "--warmup", str(2 * workers + 1)]
    args += ["--batches", str(setup["batches"]), "--scale", *(str(s) for s in setup["scale"].get(policy, (0.08, 1)))]
    args += ["--profile", str(setup["profile"])] if side == "timm" and setup["profile"] else []
    env = {**bench.env, **({"PYTHONPATH": setup["timm_path"]} if side == "timm" else {})}
    print(f"  loader: {side} {policy}, {workers} worker(s)", flush=True)
    cmd = [sys.executable, str(Path(__file__).with_name("loader_child.py")), "loader", *args]
    try:
        done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    except subprocess.TimeoutExpired:
        return {"error": "timed out after 600 s"}
    lines = done.stdout.strip().splitlines()
    if done.returncode != 0 or not lines:
        tail = (done.stderr or done.stdout).strip().splitlines()
        return {"error": tail[-1] if tail else f"exit {done.returncode}"}
    return json.loads(lines[-1])


def augment_loaders(bench, rounds: int) -> dict:
    """Ours against timm for each policy and worker count, `rounds` interleaved rounds; the ratio round by round."""
    per_class, photo, crop, batch, batches = QUICK if bench.quick else FULL
    root = photo_folder(bench.workdir, per_class, photo)
    timm_path, timm_note = install_timm(bench.workdir)
    counts = [1] if bench.quick else sorted({1, available_cpus()})
    setup = {"root": root, "crop": crop, "batch": batch, "batches": batches, "scale": {}, "timm_path": timm_path}
    runs = {(policy, workers): {"ours": [], "timm": []} for workers in counts for policy in POLICIES}
    load = [os.getloadavg()[0]]  # this machine's other work: the rounds are interleaved so that it hits both sides
    for round_ in range(rounds):
        for (policy, workers), done in runs.items():
            for side in ("ours", "timm") if round_ % 2 == 0 else ("timm", "ours"):
                if side == "timm" and timm_path is None:
                    continue
                setup["profile"] = (8 if bench.quick else 64) if round_ == 0 and workers == 1 else 0
                run = _loader_run(bench, side, policy, workers, setup)
                if side == "ours" and run.get("crop_scale"):  # timm crops as ours does (round 0: ours goes first)
                    setup["scale"][policy] = run["crop_scale"]
                done[side].append(run)
    files = sorted((root / "train").rglob("*.jpg"))
    return {
        "folder": {"train_files": len(files), "size": list(photo), "kib_per_image": _mean_kib(files)},
        "crop": crop,
        "batch": batch,
        "measured_batches": batches,
        "rounds": rounds,
        "crop_scale": setup["scale"],
        "load_average_1min": [*load, os.getloadavg()[0]],  # before and after
        "timm": {"version": TIMM_VERSION, "policy": TIMM_POLICY, "note": timm_note or "measured"},
        "rows": [_loader_row(policy, workers, done) for (policy, workers), done in runs.items()],
    }


def _mean_kib(files: list[Path]) -> float:
    return sum(f.stat().st_size for f in files) / max(1, len(files)) / 1024


def _loader_row(policy: str, workers: int, done: dict[str, list[dict]]) -> dict:
    ours = [r.get("images_per_sec") for r in done["ours"]]
    timm = [r.get("images_per_sec") for r in done["timm"]]
    ratios = [a / b for a, b in zip(ours, timm, strict=False) if a and b]  # round by round
    timed = [r["stage_ms"] for r in done["ours"] if "stage_ms" in r]
    row = {
        "policy": policy,
        "workers": workers,
        "timm_policy": TIMM_POLICY[policy],
        "ours": _spread([v for v in ours if v]),
        "timm": _spread([v for v in timm if v]),
        "ratio": _spread(ratios),
        "ours_stage_ms": {s: statistics.median(t[s] for t in timed) for s in STAGES} if timed else None,
        "ours_transform": next((r["transform"] for r in done["ours"] if "transform" in r), None),
        "timm_transform": next((r["transform"] for r in done["timm"] if "transform" in r), None),
        "timm_profile_ms": next((r["profile_ms"] for r in done["timm"] if r.get("profile_ms")), None),
        "errors": sorted({r["error"] for r in done["ours"] + done["timm"] if "error" in r}),
    }
    for side in ("ours", "timm"):
        row[f"{side}_per_worker"] = row[side]["median"] / workers if row[side] else None
    return row


# ----------------------------------------------------------------------------- recipe-cost
RECIPE_VARIANTS = {
    "baseline": [],
    "mixup 0.2 + cutmix 1.0": ["train.mixup_alpha=0.2", "train.cutmix_alpha=1.0"],
    "EMA 0.999, every step": ["train.ema_decay=0.999", "train.ema_every_n_steps=1"],
    "both": ["train.mixup_alpha=0.2", "train.cutmix_alpha=1.0", "train.ema_decay=0.999", "train.ema_every_n_steps=1"],
}


def recipe_cost(bench, rounds: int) -> dict:
    """Step time of each variant, `rounds` interleaved rounds (the order reversed every other round), and its
    ratio to the same round's baseline."""
    cuda = torch.cuda.is_available()
    # (steps, window, warm-up steps, batch): CPU, ResNet-18 at 32 px: about 0.3 s a step on 2 cores
    steps, window, warmup, batch = (6, 2, 2, 32) if bench.quick else ((400, 25, 100, 256) if cuda else (40, 5, 10, 64))
    base = [
        "dataset=synthetic",
        "dataset.image_size=32",
        "model=resnet18",
        f"data.batch_size={batch}",
        f"train.max_steps={steps}",
        "train.epochs=1",
        f"dataset.num_train={batch * (steps + 1)}",
        "dataset.num_val=64",
        f"metrics.log_every_n_steps={window}",
        f"metrics.skip_first_steps={warmup}",
        "metrics.compute_probe=false",
    ]
    runs: dict[str, list[dict]] = {name: [] for name in RECIPE_VARIANTS}
    load = [os.getloadavg()[0]]
    for round_ in range(rounds):
        for name in list(RECIPE_VARIANTS) if round_ % 2 == 0 else reversed(list(RECIPE_VARIANTS)):
            run = bench.train(*base, *RECIPE_VARIANTS[name])
            windows = run.get("images_per_sec_windows") or []  # every window's steps are whole batches
            run["step_ms"] = statistics.median(1000 * batch / rate for rate in windows) if windows else None
            runs[name].append(run)
    baseline = [run["step_ms"] for run in runs["baseline"]]
    rows = []
    for name, done in runs.items():
        step_ms = [run["step_ms"] for run in done]
        ratios = [v / b for v, b in zip(step_ms, baseline, strict=True) if v and b] if name != "baseline" else []
        rows.append(
            {
                "variant": name,
                "overrides": RECIPE_VARIANTS[name],
                "step_ms": _spread([v for v in step_ms if v]),
                "ratio": _spread(ratios),
                "command": done[0].get("command"),
                "errors": sorted({run["error"] for run in done if "error" in run}),
            }
        )
    device = torch.cuda.get_device_name(0) if cuda else "cpu"
    return {
        "device": device,
        "batch": batch,
        "steps": steps,
        "window": window,
        "warmup": warmup,
        "rounds": rounds,
        "base": base,
        "load_average_1min": [*load, os.getloadavg()[0]],  # before and after
        "rows": rows,
    }


# ----------------------------------------------------------------------------- the report
def _cell(s: dict | None, fmt: str = ",.0f") -> str:
    return f"{s['median']:{fmt}} ({s['min']:{fmt}}-{s['max']:{fmt}})" if s else "—"


def render(report: dict) -> list[str]:
    """The markdown of whichever of the two sections the report holds."""
    lines: list[str] = []
    if "augment_loaders" in report:
        lines += _render_loaders(report["augment_loaders"])
    if "recipe_cost" in report:
        result = report["recipe_cost"]
        lines += [
            "",
            f"### Cost of mixup/cutmix and EMA per step ({result['device']}, {result['rounds']} interleaved rounds)",
            "",
        ]
        lines += [
            f"`python train.py {' '.join(result['base'])}` plus each variant's keys: ResNet-18, batch "
            f"{result['batch']}, {result['steps']} steps, the median of the logging windows of "
            f"{result['window']} steps after the first {result['warmup']}.",
            "",
        ]
        lines.append(f"1-minute load average before and after: {_loads(result)}.")
        lines += [
            "",
            "| variant | step ms, median (min-max) | / the round's baseline, median (min-max) | every round | errors |",
        ]
        lines += ["| --- | ---: | ---: | --- | --- |"]
        for row in result["rows"]:
            ratio = _cell(row["ratio"], ".3f") + "x" if row["ratio"] else "—"
            clear = {"above": "slower", "below": "faster", "across": "not separated"}.get(_against_one(row["ratio"]))
            lines.append(
                f"| {row['variant']} | {_cell(row['step_ms'], '.1f')} | {ratio} | {clear or '—'} "
                f"| {'; '.join(row['errors'])} |"
            )
    return lines


def _render_loaders(result: dict) -> list[str]:
    folder, timm = result["folder"], result["timm"]
    width, height = folder["size"]
    lines = ["", f"### Augmentation policies: our training loader against timm {timm['version']}'s (CPU)", ""]
    lines.append(
        f"{folder['train_files']} JPEGs of {width}x{height} (a quarter {height}x{width}), "
        f"{folder['kib_per_image']:.0f} KiB each; crop {result['crop']} px, batch {result['batch']}, "
        f"{result['measured_batches']} batches measured after 2 x workers + 1; {result['rounds']} interleaved "
        f"rounds; each measurement a process of its own. timm: {timm['note']}. 1-minute load average before and "
        f"after: {_loads(result)}."
    )
    lines += [
        "",
        "| policy | timm's `auto_augment` | workers | ours: images/s | timm: images/s | ours / timm, per "
        "round | ours per worker | timm per worker | >= 1.0x in every round |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | --- |",
    ]
    for row in result["rows"]:
        ratio = row["ratio"]
        verdict = {"above": "met", "below": "no", "across": "not separated"}.get(_against_one(ratio), "—")
        cells = [
            row["policy"],
            f"`{row['timm_policy']}`",
            str(row["workers"]),
            _cell(row["ours"]),
            _cell(row["timm"]),
            (_cell(ratio, ".2f") + "x") if ratio else "—",
            _rate(row["ours_per_worker"]),
            _rate(row["timm_per_worker"]),
            verdict + (f" (errors: {'; '.join(row['errors'])})" if row["errors"] else ""),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    lines += [
        "",
        "Where the time goes, ms per image: ours from the batches' own clocks (Batch.times, in the workers; "
        "augment is the batched crop's share plus the policy; the policy alone: augment less rrc_flip's at the same "
        "workers; busy: all of a worker's time per image), timm's timed step by step in its process on one thread "
        "(first round, 1 worker).",
        "",
        "| policy | workers | ours: read / decode / augment / collate (busy) | ours: the policy alone "
        "| timm, per step |",
        "| --- | ---: | --- | ---: | --- |",
    ]
    crop_only = {r["workers"]: r["ours_stage_ms"] for r in result["rows"] if r["policy"] == "rrc_flip"}
    for row in result["rows"]:
        ms, base = row["ours_stage_ms"], crop_only.get(row["workers"])
        ours = " / ".join(f"{ms[s]:.2f}" for s in STAGES[:4]) + f" ({ms['busy']:.2f})" if ms else "—"
        alone = f"{ms['augment'] - base['augment']:.2f}" if ms and base and row["policy"] != "rrc_flip" else "—"
        profile = row["timm_profile_ms"]
        timm_ms = (
            ", ".join(f"{k} {v:.2f}" for k, v in profile.items()) + f"; total {sum(profile.values()):.2f}"
            if profile
            else "—"
        )
        lines.append(f"| {row['policy']} | {row['workers']} | {ours} | {alone} | {timm_ms} |")
    return lines


def _against_one(ratio: dict | None) -> str | None:
    """Where every round's ratio lies against 1.0x: "above" (all >= 1), "below" (all < 1) or "across"; None: no
    ratio. A verdict needs every round on one side, not the median alone."""
    if not ratio:
        return None
    return "above" if ratio["min"] >= 1 else "below" if ratio["max"] < 1 else "across"


def _loads(result: dict) -> str:
    return " and ".join(f"{v:.2f}" for v in result.get("load_average_1min", []))


def _rate(value: float | None) -> str:
    return f"{value:,.0f}" if value else "—"
