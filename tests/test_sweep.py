"""Sweeps that end with a report: summary files, a plot, failed jobs as rows, ceiling modes, Optuna search."""

from __future__ import annotations

import csv
import json
import logging
import math
import os
import random
import re
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from helpers import CONF_DIR, FAST, ROOT, _env, _wait_for, compose_cfg, run_train
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf
from PIL import Image

from imgtrain.common.errors import RunEnded
from imgtrain.metrics import report, spread
from imgtrain.sweep.plot import plot
from imgtrain.sweep.rank import MEMORY_NOISE, MIN_GAIN, cheapest, decision, drift, memory_noise, pool_repeats
from imgtrain.sweep.report import SweepReport, build_report, collect, rank, read_job, recipe_note, reproduce_command
from imgtrain.train.run import run

# The sweeps override data.num_workers. A window per step: 6 steady windows of 8 steps, enough for an interval.
SWEEP = [*FAST, "metrics.log_every_n_steps=1"]


def _sweep(args: list[str], sweep_dir: Path, data_dir: Path):
    result = run_train(["-m", *args, f"hydra.sweep.dir={sweep_dir}"], sweep_dir / "unused", data_dir, timeout=600)
    assert result.returncode == 0, result.stderr[-4000:]
    return result


def _csv_rows(sweep_dir: Path) -> list[dict[str, str]]:
    with open(sweep_dir / "sweep_summary.csv") as f:
        return list(csv.DictReader(f))


def test_worker_sweep_report(tmp_path: Path, data_dir: Path) -> None:
    sweep = tmp_path / "sweep"
    args = ["data.num_workers=0,1", "data.prefetch_factor=4", "data.persistent_workers=true", *SWEEP]
    result = _sweep(args, sweep, data_dir)
    rows = _csv_rows(sweep)
    assert [row["data.num_workers"] for row in rows] == ["0", "1"]
    assert all(row["status"] == "ok" for row in rows)
    for column in (
        "images_per_sec_median",
        "images_per_sec_p25",
        "images_per_sec_p75",
        "data_wait_frac",
        "gpu_util_mean",
        "cpu_pct_mean",
        "rss_peak_gb",
        "val_acc",
        "verdict",
        "confidence",
    ):
        assert column in rows[0]
    assert all(float(row["images_per_sec"]) > 0 and float(row["rss_peak_gb"]) > 0 for row in rows)
    assert all(row["gpu_util_mean"] == "" for row in rows)  # CPU: empty, not zero
    markdown = (sweep / "sweep_summary.md").read_text()
    assert sum(line.startswith("| ") for line in markdown.splitlines()) == 3  # header + 2 rows
    assert "Fastest here: data.num_workers=" in markdown or "Tied within noise: data.num_workers=0" in markdown
    assert all(row["standing"] for row in rows) and all(float(row["interval_low"]) > 0 for row in rows)
    with Image.open(sweep / "sweep_summary.png") as image:
        assert image.format == "PNG" and image.size[0] > 400
    assert "Fastest here: data.num_workers=" in result.stdout or "Tied within noise: " in result.stdout
    assert "Reproduce it: python train.py data.num_workers=" in result.stdout


@pytest.mark.slow  # a multirun of real train.py processes
def test_a_failed_job_is_a_row(tmp_path: Path, data_dir: Path) -> None:
    sweep = tmp_path / "sweep"
    _sweep(
        ["data.batch_size=32,100000", "data.num_workers=0", *[o for o in SWEEP if "batch_size" not in o]],
        sweep,
        data_dir,
    )
    rows = _csv_rows(sweep)
    assert [row["status"] for row in rows] == ["ok", "failed"]
    assert "data.batch_size=100000" in rows[1]["reason"] and "larger than the training split" in rows[1]["reason"]
    assert not (sweep / "1" / "metrics.json").exists()


@pytest.mark.slow  # a real process group and a real Ctrl-C during the second job of a sweep
def test_ctrl_c_in_a_sweep_saves_the_job_ends_the_sweep_and_reports_the_finished_ones(tmp_path: Path, data_dir: Path):
    sweep = tmp_path / "sweep"
    cmd = [sys.executable, str(ROOT / "train.py"), "-m", *SWEEP, "train.epochs=1,40,1", f"hydra.sweep.dir={sweep}"]
    pipes = {"stdout": subprocess.PIPE, "stderr": subprocess.PIPE}
    proc = subprocess.Popen(cmd, cwd=ROOT, env=_env(data_dir), text=True, start_new_session=True, **pipes)
    _wait_for(sweep / "1" / "checkpoints" / "last.pt", proc)
    os.killpg(proc.pid, signal.SIGINT)
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 130, stderr[-3000:]
    assert "stopped: SIGINT at step" in stderr and "Traceback" not in stderr
    rows = _csv_rows(sweep)
    assert [(row["job"], row["status"]) for row in rows] == [("0", "ok"), ("1", "stopped")]  # job 2 never started
    assert rows[1]["reason"].startswith("stopped: SIGINT at step")
    assert (sweep / "sweep_summary.md").exists() and not (sweep / "2").exists()


@pytest.mark.parametrize("mode", ["loader", "compute"])
def test_ceiling_modes(tmp_path: Path, mode: str) -> None:
    overrides = [
        "dataset=synthetic",
        "dataset.image_size=32",
        "dataset.num_train=128",
        "dataset.num_val=16",
        "data.batch_size=16",
        "data.num_workers=0",
        "train.max_steps=6",
        "metrics.skip_first_steps=1",
        "metrics.log_every_n_steps=2",
        f"mode={mode}",
        "optimized_metric=images_per_sec",
    ]
    value = run(compose_cfg(*overrides, output_dir=str(tmp_path)))
    metrics = json.loads((tmp_path / "metrics.json").read_text())
    assert metrics["mode"] == mode and metrics["steps"] == 6
    assert value == pytest.approx(metrics["images_per_sec"]) and value > 0
    assert metrics["val_acc"] is None  # the ceiling modes measure speed only
    if mode == "compute":
        assert metrics["data_wait_frac"] < 0.05  # the batch is already on the device


@pytest.mark.slow  # a multirun of real train.py processes
def test_optuna_search(tmp_path: Path, data_dir: Path) -> None:
    sweep = tmp_path / "sweep"
    # A fixed batch (the command line wins over the search space): 256 images give every trial 8 steps with
    # steady-state windows to report. A larger batch would leave too few steps to measure.
    args = ["hparams_search=loader", "hydra.sweeper.n_trials=3", "train.max_steps=8", *SWEEP]
    args += ["train.epochs=4", "data.batch_size=32"]
    result = _sweep(args, sweep, data_dir)
    assert "Best value:" in result.stdout
    results = (sweep / "optimization_results.yaml").read_text()
    assert "best_params" in results and "data.num_workers" in results
    assert len(_csv_rows(sweep)) == 3


def _summary(wait: float, workers: int, cpus: int = 8, device: str = "cuda:0", **loader) -> dict:
    loader = {"num_workers": workers, "pin_memory": True, "persistent_workers": True, "prefetch_factor": 2, **loader}
    return {
        "mode": "train",
        "data_wait_frac": wait,
        "loader": loader,
        "cpu_count": cpus,
        "world_size": 1,
        "device": device,
    }


def test_verdict_and_next_setting() -> None:
    assert report.verdict(_summary(0.02, 2)).startswith("compute-bound")
    assert report.verdict(_summary(0.4, 2)).endswith("try data.num_workers=4")
    assert report.suggest_next(_summary(0.4, 0)) == "data.num_workers=1"
    assert report.suggest_next(_summary(0.4, 7, pin_memory=False)) == "data.pin_memory=true"
    assert report.suggest_next(_summary(0.4, 7, persistent_workers=False)) == "data.persistent_workers=true"
    assert report.suggest_next(_summary(0.4, 7)) == "data.prefetch_factor=4"
    assert report.verdict({**_summary(0.4, 2), "mode": "loader"}) == ""


def _synthetic_job(
    tmp_path: Path,
    num: int,
    windows: list[float],
    pss: float = 1.0,
    pin: bool = False,
    job: int | None = None,
    **loader: Any,
) -> dict:
    """A finished job with these window rates (one process), `num` workers and this memory peak; with `job`,
    that job number and `repeat=<job>` among its overrides."""
    folder = tmp_path / str(num if job is None else job)
    (folder / ".hydra").mkdir(parents=True)
    repeat = "" if job is None else f"- repeat={job}\n"
    (folder / ".hydra" / "overrides.yaml").write_text(f"{repeat}- data.num_workers={num}\n")
    metrics = {
        "images_per_sec": sum(windows) / len(windows),
        "images_per_sec_per_process": sum(windows) / len(windows),
        "images_per_sec_median": sorted(windows)[len(windows) // 2],
        "images_per_sec_windows": windows,
        "data_wait_frac": 0.1,
        "mode": "train",
        "pss_peak_gb": pss,
        "loader": {"num_workers": num, "pin_memory": pin, **loader},
    }
    (folder / "metrics.json").write_text(json.dumps(metrics))
    return read_job(folder)


def _series(mean: float, noise: float, n: int = 12, seed: int = 0) -> list[float]:
    """`n` window rates around `mean`, uniformly within +-noise (a known mean and spread)."""
    rng = random.Random(seed)
    return [mean + rng.uniform(-noise, noise) for _ in range(n)]


def test_a_setting_separated_from_the_rest_is_named_fastest(tmp_path: Path) -> None:
    rows = [_synthetic_job(tmp_path, w, _series(mean, 5, seed=w)) for w, mean in ((0, 100), (1, 150), (2, 200))]
    best = rank(rows)
    assert best is rows[2] and [row["standing"] for row in rows] == ["slower", "slower", "fastest"]
    assert rows[2]["interval_low"] > rows[1]["interval_high"]
    line = decision(rows, ["data.num_workers"], best)
    assert line.startswith("Fastest here: data.num_workers=2 at ") and "clear of the 2 other(s)" in line


def test_a_tie_within_noise_recommends_the_cheapest_setting(tmp_path: Path) -> None:
    """Three settings with the same mean and 5% noise: no winner; the fewest workers is recommended, even when
    a more expensive one happened to have the highest median."""
    rows = [_synthetic_job(tmp_path, w, _series(200, 10, seed=w + 7)) for w in (0, 2, 4)]
    rows[0]["rate_median"] = min(row["rate_median"] for row in rows) - 0.1  # the cheapest is not the leader
    best = rank(rows)
    assert best is rows[0] and best["standing"] == "recommended: cheapest of a tie"
    assert [row["standing"] for row in rows[1:]] == ["tied", "tied"]
    line = decision(rows, ["data.num_workers"], best)
    assert line.startswith(
        "Tied within noise: data.num_workers=0, data.num_workers=2, data.num_workers=4 (their intervals overlap, or "
        "they differ by less than the sweep's resolution, 10%"
    )
    assert "Recommended: data.num_workers=0, the cheapest of them (pin_memory=false, then fewest workers" in line
    assert "memory peak is within 10% of the lowest" in line


def test_a_tie_goes_to_unpinned_then_fewer_workers_prefetch_and_no_persistent_workers(tmp_path: Path) -> None:
    """Memory peaks 2% apart are noise: the order decides, pin_memory=false first (the issue's sweep, 2 CPUs,
    recommended pin_memory=true on a PSS a few percent lower)."""
    job = lambda name, num, pss, **loader: _synthetic_job(tmp_path / name, num, _series(200, 10), pss=pss, **loader)  # noqa: E731
    pinned, unpinned = job("a", 1, 1.00, pin=True), job("b", 1, 1.02, pin=False)
    assert cheapest([pinned, unpinned]) is unpinned
    one, two = job("c", 1, 1.02, prefetch_factor=4), job("d", 2, 1.00, prefetch_factor=2)
    assert cheapest([two, one]) is one  # fewer workers before fewer prefetched batches
    deep, shallow = job("e", 2, 1.00, prefetch_factor=4), job("f", 2, 1.02, prefetch_factor=2)
    assert cheapest([deep, shallow]) is shallow
    kept, fresh = job("g", 2, 1.00, persistent_workers=True), job("h", 2, 1.02, persistent_workers=False)
    assert cheapest([kept, fresh]) is fresh
    assert cheapest([job("i", 0, 1.02), job("j", 0, 1.00)])["pss_peak_gb"] == 1.00  # all else equal: the lower


def test_a_tie_rules_out_a_setting_whose_memory_is_clearly_higher(tmp_path: Path) -> None:
    """40% more memory is a real cost: the unpinned setting that needs it loses to the pinned one that does not;
    with repeats, the most one setting's PSS moved between its runs widens the band."""
    job = lambda name, num, pss, **kw: _synthetic_job(tmp_path / name, num, _series(200, 10), pss=pss, **kw)  # noqa: E731
    pinned, unpinned = job("a", 1, 1.00, pin=True), job("b", 1, 1.40, pin=False)
    assert cheapest([pinned, unpinned]) is pinned
    assert cheapest([pinned, unpinned], noise=0.5) is unpinned
    runs = [job(str(i), 1, pss, pin=False, job=i) for i, pss in enumerate((1.0, 1.6))]  # repeat=0,1, one setting
    assert memory_noise(pool_repeats(runs)) == pytest.approx(0.6)
    settings = [job("x", 0, 1.0), job("y", 2, 1.5)]
    assert memory_noise(pool_repeats(settings)) == MEMORY_NOISE  # no repeats: the assumed 10%


def test_too_few_windows_is_said_and_not_ranked(tmp_path: Path) -> None:
    short = _synthetic_job(tmp_path, 0, [500.0, 510.0, 505.0])  # the fastest median, but 3 windows
    long = _synthetic_job(tmp_path, 1, _series(200, 5))
    best = rank([short, long])
    assert best is long and short["standing"] == "not ranked" and "not ranked: too few windows" in short["confidence"]
    assert spread.median_interval([1.0] * (spread.MIN_WINDOWS - 1)) is None
    assert report.too_few_windows(3, 10, 20).startswith("no interval: 3 steady-state window(s), 6 needed")
    assert "run at least 150 steps (train.max_steps, train.epochs)" in report.too_few_windows(3, 10, 20)
    assert decision([short], ["data.num_workers"], rank([short])).startswith("No job can be ranked: too few")


def test_the_median_interval_holds_the_median_as_often_as_it_says() -> None:
    """Order-statistic intervals of 2000 samples of 12 draws from a skewed distribution cover its median at
    least 95% of the time; with 6 draws the interval is the extremes."""
    rng = random.Random(0)
    true_median = math.log(2)  # of the exponential distribution with rate 1
    covered = 0
    for _ in range(2000):
        low, high = spread.median_interval([rng.expovariate(1.0) for _ in range(12)])
        covered += low <= true_median <= high
    assert covered / 2000 >= 0.95
    assert spread.median_interval([3.0, 1.0, 2.0, 6.0, 5.0, 4.0]) == (1.0, 6.0)
    assert spread.median_interval(list(range(12))) == (2, 9)


def test_rank_marks_noise(tmp_path: Path) -> None:
    noisy = _synthetic_job(tmp_path, 0, [40, 90, 60, 20, 80, 70, 30, 50])
    rank([noisy])
    assert "noisy" in noisy["confidence"]


def test_ceilings_line_names_the_limit_only_when_the_intervals_tell_it() -> None:
    from imgtrain.sweep.report import ceilings

    def row(mode: str, rate: float, noise: float = 5.0) -> dict:
        figures = {"images_per_sec": rate, "rate_median": rate, "windows_all_ranks": [rate] * 6}
        return {"status": "ok", "mode": mode, **figures, "interval_low": rate - noise, "interval_high": rate + noise}

    line = ceilings([row("loader", 300.0), row("compute", 900.0), row("train", 270.0)])
    assert "input pipeline 300.0 images/s (95% interval 295.0-305.0, 6 samples)" in line
    assert "input-bound: the input pipeline is the limit" in line and "(90% of the lower)" in line
    assert "compute-bound: the model is the limit" in ceilings([row("loader", 3000.0), row("compute", 900.0)])
    close = ceilings([row("loader", 890.0, 10.0), row("compute", 900.0, 10.0), row("train", 905.0)])
    assert "-> the two are indistinguishable;" in close and "indistinguishable from the lower ceiling" in close
    assert "%" not in close.split("training reached")[1]  # never "training reached 102% of the ceiling"
    assert ceilings([row("train", 270.0)]) == ""


def test_the_plot_is_drawn_for_one_window_and_for_a_job_without_a_figure(tmp_path: Path) -> None:
    """A short sweep: one steady window per job, too few to rank (the median unrounded, the window rounded in
    metrics.json), and a job too short for any window. It used to end with "'yerr' must not contain negative
    values" and no PNG."""
    for num, (median, windows) in enumerate([(101.234567, [101.23]), (99.4449, [99.44]), (None, [])]):
        folder = tmp_path / str(num)
        (folder / ".hydra").mkdir(parents=True)
        (folder / ".hydra" / "overrides.yaml").write_text(f"- data.num_workers={num}\n")
        metrics = {
            "images_per_sec": median,
            "images_per_sec_median": median,
            "images_per_sec_windows": windows,
            "data_wait_frac": 0.1 if median else None,
            "mode": "train",
        }
        (folder / "metrics.json").write_text(json.dumps(metrics))
    assert build_report(tmp_path) is None  # one window each: too few to rank, and the report says so
    assert (tmp_path / "sweep_summary.png").stat().st_size > 0
    assert "No job can be ranked: too few windows" in (tmp_path / "sweep_summary.md").read_text()


def _stages(read: float, decode: float, h2d: float | None = None) -> dict:
    times = {"read": read, "decode": decode, "augment": 0.2, "collate": 0.01, "transfer": 0.02}
    return {**times, "h2d": h2d, "gpu_decode": None}


def _fake_job(sweep: Path, num: int, overrides: list[str], metrics: dict | None, **extra) -> None:
    """A job folder as a sweep leaves it: overrides, and metrics.json (a finished job) or failed.json."""
    folder = sweep / str(num)
    (folder / ".hydra").mkdir(parents=True)
    (folder / ".hydra" / "overrides.yaml").write_text("".join(f"- {o}\n" for o in overrides))
    if metrics is None:
        (folder / "failed.json").write_text(json.dumps({"status": "failed", "error": "DataLoader worker killed"}))
        return
    windows = metrics.pop("windows", [])
    rate = metrics.pop("rate", None)
    median = sorted(windows)[len(windows) // 2] if windows else None
    figures = {"images_per_sec": rate, "images_per_sec_median": median, "images_per_sec_windows": windows}
    figures.update({"data_wait_frac": 0.1 if rate else None, "mode": "train", "rss_peak_gb": 1.0})
    (folder / "metrics.json").write_text(json.dumps({**figures, **metrics, **extra}))


def _mixed_sweep(sweep: Path) -> None:
    """Two jobs with stage times and tune probes (six windows each), a failed job, one without figures, an older
    one-window job (not ranked),
    and the two ceiling modes."""
    pipeline0 = {"stage_ms_per_image": _stages(0.05, 0.4), "worker_busy_frac": 0.8, "input_stage": "decode"}
    pipeline1 = {"stage_ms_per_image": _stages(0.06, 0.3, h2d=0.03), "worker_busy_frac": 0.5, "input_stage": None}
    tune0 = {"table": [{"num_workers": 0, "images_per_sec": 80.0}, {"num_workers": 1, "images_per_sec": 150.0}]}
    tune1 = {"table": [{"num_workers": 1, "images_per_sec": 170.0}], "compute_images_per_sec": 125.0, "chosen": 1}
    tune1["compute_images_per_sec_interval"] = [119.0, 131.0]
    _fake_job(
        sweep,
        0,
        ["data.num_workers=0"],
        {
            "rate": 80.0,
            "windows": [78.0, 80.0, 82.0, 79.0, 81.0, 80.0],
            "pipeline": {**pipeline0, "compute_images_per_sec": 150.0},
        },
        tune={**tune0, "compute_images_per_sec": 120.0, "chosen": 1, "reason": "fastest"},
        pss_peak_gb=0.9,
    )
    job1 = {"rate": 140.0, "windows": [139.0, 141.0, 140.0, 138.0, 142.0, 140.0], "pipeline": pipeline1}
    _fake_job(sweep, 1, ["data.num_workers=1"], job1, tune=tune1)
    _fake_job(sweep, 2, ["data.num_workers=2"], None)  # failed
    too_short = {"tune": None, "pipeline": None, "images_per_sec_note": "not measured: no steady-state window closed"}
    _fake_job(sweep, 3, ["data.num_workers=3"], too_short)
    _fake_job(sweep, 4, ["data.num_workers=4"], {"rate": 100.0, "windows": [100.0]})  # older: no pipeline
    _fake_job(sweep, 5, ["data.num_workers=5", "mode=loader"], {"rate": 300.0, "windows": [300.0], "mode": "loader"})
    _fake_job(sweep, 6, ["data.num_workers=6", "mode=compute"], {"rate": 900.0, "windows": [900.0], "mode": "compute"})


def _drawn(sweep: Path):
    rows, swept = collect(sweep)
    best = rank(rows)
    return best, plot(None, rows, swept, best)  # drawn, not saved: saving is what build_report tests


def test_the_plot_stars_the_fastest_job_and_draws_every_ceiling(tmp_path: Path) -> None:
    from imgtrain.sweep.report import build_report

    _mixed_sweep(tmp_path)
    assert build_report(tmp_path)["job"] == "1"
    with Image.open(tmp_path / "sweep_summary.png") as image:
        assert image.format == "PNG"
    best, fig = _drawn(tmp_path)
    rate_ax = next(ax for ax in fig.axes if ax.get_title() == "Throughput")
    (star,) = [line for line in rate_ax.get_lines() if line.get_gid() == "fastest"]
    assert list(star.get_xdata()) == [1.0] and list(star.get_ydata()) == [140.0] and star.get_marker() == "*"
    assert any("job 1: fastest" in text.get_text() and "140.0 images/s" in text.get_text() for text in rate_ax.texts)
    ceilings = sorted(line.get_ydata()[0] for line in rate_ax.get_lines() if line.get_gid() == "ceiling")
    # mode=loader 300, mode=compute 900, the best tune table entry 170, tune compute 125, the run's compute 150
    assert ceilings == [125.0, 150.0, 170.0, 300.0, 900.0]
    labels = [text.get_text() for text in rate_ax.get_legend().get_texts()]
    assert "loader ceiling (tune probe, best of 2 jobs): 170.0 images/s, no interval" in labels
    assert "compute ceiling (mode=compute): 900.0 images/s, no interval" in labels
    (band,) = [patch for patch in rate_ax.patches if patch.get_gid() == "ceiling band"]  # tune's compute only
    assert (band.get_y(), band.get_height()) == (119.0, 12.0)
    tuned = "compute ceiling (tune probe, best of 2 jobs): 125.0 images/s, 95% interval 119.0-131.0; job 1 above it"
    assert any(label.startswith(tuned) for label in labels)
    figures = {text.get_text() for text in rate_ax.texts} - {"job 1: fastest\n140.0 images/s (median window)"}
    assert {"125.0", "300.0", "900.0"} <= figures <= {"125.0", "150.0", "170.0", "300.0", "900.0"}


def test_the_stage_panel_stacks_each_measured_stage_per_job(tmp_path: Path) -> None:
    _mixed_sweep(tmp_path)
    _, fig = _drawn(tmp_path)
    (stage_ax,) = [ax for ax in fig.axes if ax.get_ylabel() == "ms per image"]
    assert "time in the workers (wall clock), summed over workers" in stage_ax.get_title()
    assert [label.get_text().split("\n")[0] for label in stage_ax.get_xticklabels()] == ["job 0", "job 1"]
    bars = {container.get_label(): container.patches for container in stage_ax.containers}
    assert list(bars) == ["read", "decode", "augment", "collate", "transfer", "h2d"]  # gpu_decode never measured
    heights = {stage: [round(p.get_height(), 6) for p in patches] for stage, patches in bars.items()}
    assert heights["read"] == [0.05, 0.06] and heights["decode"] == [0.4, 0.3] and heights["h2d"] == [0.0, 0.03]
    assert bars["decode"][1].get_y() == pytest.approx(0.06)  # stacked on read
    assert bars["h2d"][1].get_y() == pytest.approx(0.06 + 0.3 + 0.2 + 0.01 + 0.02)


def test_the_plot_survives_sweeps_without_stage_times_or_figures(tmp_path: Path) -> None:
    from imgtrain.sweep.report import build_report

    for name, jobs in {
        "old": [{"rate": 90.0, "windows": [90.0] * 6}, {"rate": 95.0, "windows": [94.0, 96.0] * 3}],
        "none": [{}, None],  # a job without figures and a failed one: no fastest job
        "mode": [{"rate": 50.0, "windows": [50.0] * 6, "mode": "loader"}],  # only a ceiling mode
    }.items():
        sweep = tmp_path / name
        for num, metrics in enumerate(jobs):
            _fake_job(
                sweep, num, [f"mode={'loader' if name == 'mode' else 'train'}", f"data.num_workers={num}"], metrics
            )
        best = build_report(sweep)
        assert (sweep / "sweep_summary.png").stat().st_size > 0
        _, fig = _drawn(sweep)
        assert len(fig.axes) == 2  # no stage panel
        stars = [line for ax in fig.axes for line in ax.get_lines() if line.get_gid() == "fastest"]
        assert len(stars) == (0 if best is None else 1)
        assert (best is None) == (name == "none")


def test_the_table_gains_pipeline_columns_only_when_measured(tmp_path: Path) -> None:
    from imgtrain.sweep.report import build_report, collect, table

    _mixed_sweep(tmp_path / "new")
    build_report(tmp_path / "new")
    rows = _csv_rows(tmp_path / "new")
    assert [row["read_ms"] for row in rows] == ["0.050", "0.060", "", "", "", "", ""]
    assert [row["decode_ms"] for row in rows[:2]] == ["0.400", "0.300"]
    assert [row["h2d_ms"] for row in rows[:2]] == ["", "0.030"]
    assert [row["input_stage"] for row in rows[:2]] == ["decode", ""]
    assert [row["worker_busy_frac"] for row in rows[:2]] == ["0.800", "0.500"]
    assert [row["pss_peak_gb"] for row in rows[:2]] == ["0.900", ""]
    assert [row["tune_chosen"] for row in rows[:2]] == ["1", "1"]
    assert "gpu_decode_ms" not in rows[0]  # empty in every row
    assert "| decode_ms |" in (tmp_path / "new" / "sweep_summary.md").read_text()
    assert rows[3]["reason"] == "not measured: no steady-state window closed"  # an ok job without a figure
    _fake_job(tmp_path / "old", 0, ["data.num_workers=0"], {"rate": 90.0, "windows": [90.0]})
    header, _ = table(*collect(tmp_path / "old"))
    assert "images_per_sec" in header
    assert not {"read_ms", "input_stage", "pss_peak_gb", "tune_chosen", "ran_on"} & set(header)


def test_the_report_says_what_the_jobs_ran_on(tmp_path: Path) -> None:
    from imgtrain.sweep.report import build_report

    env = {"hostname": "node1", "gpu_name": "NVIDIA H100", "cuda": "12.4", "torch": "2.5.1", "cpus_available": 16}
    for name, second in {"same": env, "moved": {**env, "hostname": "node2", "cpus_available": 8}}.items():
        sweep = tmp_path / name
        _fake_job(sweep, 0, ["data.num_workers=0"], {"rate": 90.0, "windows": [90.0]}, environment=env)
        _fake_job(sweep, 1, ["data.num_workers=1"], {"rate": 95.0, "windows": [95.0]}, environment=second)
        _fake_job(sweep, 2, ["data.num_workers=2"], None)  # failed: no environment, not a difference
        build_report(sweep)
        markdown = (sweep / "sweep_summary.md").read_text()
        assert "Ran on: host node1, NVIDIA H100, CUDA 12.4, torch 2.5.1, 16 CPUs available" in markdown
        warned = "ran on different machines (hostname: node1, node2; cpus_available: 16, 8)" in markdown
        assert warned == (name == "moved")
        assert ("ran_on" in _csv_rows(sweep)[0]) == (name == "moved")
    assert (
        _csv_rows(tmp_path / "moved")[1]["ran_on"] == "hostname=node2 gpu_name=NVIDIA H100 torch=2.5.1 cpus_available=8"
    )


def test_the_plot_is_honest_about_scale_noise_and_ceilings(tmp_path: Path) -> None:
    """Throughput from zero, each ranked point with its 95% interval, an unranked one hollow, and a job drawn
    above a ceiling says so in the ceiling's legend entry."""
    _mixed_sweep(tmp_path)
    _, fig = _drawn(tmp_path)
    rate_ax = next(ax for ax in fig.axes if ax.get_title() == "Throughput")
    assert rate_ax.get_ylim()[0] == 0 and "95% interval" in rate_ax.get_ylabel()
    labels = rate_ax.get_legend_handles_labels()[1]
    assert any(label.startswith("hollow: too few windows") for label in labels)  # job 4: one window
    above = [label for label in labels if "above it" in label]
    assert above and all("job 1" in label for label in above)  # 140 img/s against the 125 of the compute probe
    bars = [c for c in rate_ax.containers if c.__class__.__name__ == "ErrorbarContainer"]
    assert len(bars) == 2  # jobs 0 and 1 (six windows each)


def test_repeats_of_a_setting_are_pooled_and_the_drift_is_measured_against_the_gaps(tmp_path: Path) -> None:
    """repeat=0,1 first on the command line: jobs 0, 1 run settings A (2 workers) and B (0 workers), jobs 2, 3
    run them again. The machine slowed by 10% between the rounds."""
    rows = [
        _synthetic_job(tmp_path, 2, _series(200, 4, seed=1), job=0),
        _synthetic_job(tmp_path, 0, _series(150, 4, seed=2), job=1),
        _synthetic_job(tmp_path, 2, _series(180, 4, seed=3), job=2),
        _synthetic_job(tmp_path, 0, _series(135, 4, seed=4), job=3),
    ]
    best = rank(rows)
    assert best is rows[0] and [row["standing"] for row in rows] == ["fastest", "slower", "fastest", "slower"]
    assert rows[0]["repeats"] == 2 and rows[0]["rate_median"] == rows[2]["rate_median"]  # pooled: 24 windows
    line = decision(rows, ["data.num_workers"], best)
    assert line.startswith("Fastest here: data.num_workers=2 at ") and "2 runs pooled" in line
    assert "clear of the 1 other(s)" in line
    moved = drift(rows)
    assert moved.startswith("Drift: a setting's last run against its first: -1") and "(median of 2)" in moved
    assert "the smallest gap between settings is 3" in moved and "larger" not in moved  # -10% against 33%
    assert reproduce_command(rows[0]) == "python train.py data.num_workers=2"  # without the repeat index


def test_drift_larger_than_the_gaps_is_said_and_no_repeats_says_how_to_measure(tmp_path: Path) -> None:
    rows = [
        _synthetic_job(tmp_path, 2, _series(200, 4, seed=1), job=0),
        _synthetic_job(tmp_path, 0, _series(190, 4, seed=2), job=1),
        _synthetic_job(tmp_path, 2, _series(150, 4, seed=3), job=2),
        _synthetic_job(tmp_path, 0, _series(143, 4, seed=4), job=3),
    ]
    rank(rows)
    assert "larger: the order in which jobs ran may decide the ranking" in drift(rows)
    single = [_synthetic_job(tmp_path / "one", w, _series(100, 4, seed=w)) for w in (0, 1)]
    assert drift(single).startswith("Drift not measured: run every setting twice, interleaved, by putting repeat")


def test_separated_intervals_closer_than_the_resolution_are_a_tie(tmp_path: Path) -> None:
    """Two settings 5% apart with tight windows: their intervals do not overlap, but without repeats a 5%
    difference is within the 10% the sweep assumes between jobs, so it is a tie and 0 workers is recommended;
    with min_gain=0.02 the faster one is named."""
    rows = [_synthetic_job(tmp_path, w, _series(mean, 2, seed=w)) for w, mean in ((0, 200), (2, 210))]
    assert rows[1]["interval_low"] > rows[0]["interval_high"]
    best = rank(rows)
    assert best is rows[0] and rows[1]["standing"] == "tied"
    assert re.search(r"\(5\.\d% slower, within the sweep's resolution\)", rows[0]["confidence"])
    assert rows[1]["confidence"].startswith("the highest median, not separated")
    line = decision(rows, ["data.num_workers"], best)
    assert line.startswith("Tied within noise: data.num_workers=0, data.num_workers=2")
    assert "10%, assumed without repeats (hydra.callbacks.sweep_report.min_gain" in line
    best = rank(rows, min_gain=0.02)
    assert best is rows[1] and best["standing"] == "fastest"
    line = decision(rows, ["data.num_workers"], best)
    assert re.search(r", by 5\.\d% or more;", line)
    assert "the sweep's resolution is 2%, assumed without repeats" in line


def test_repeats_measure_the_resolution_between_jobs(tmp_path: Path) -> None:
    """Each setting run twice; one setting's runs differ by 15%: settings 12% apart are then a tie, even with
    intervals apart, while settings 30% apart stay separated."""
    rows = [
        _synthetic_job(tmp_path, 2, _series(230, 2, seed=1), job=0),
        _synthetic_job(tmp_path, 0, _series(200, 2, seed=2), job=1),
        _synthetic_job(tmp_path, 2, _series(200, 2, seed=3), job=2),
        _synthetic_job(tmp_path, 0, _series(190, 2, seed=4), job=3),
    ]
    best = rank(rows, min_gain=0.0)  # the measured resolution replaces min_gain
    assert best is rows[1] and rows[0]["standing"] == "tied"
    assert re.match(r"15\.\d%, the most two runs of one setting differed by in this sweep", best["resolution"])
    faster = [_synthetic_job(tmp_path / "b", 2, _series(m, 2, seed=m), job=j) for j, m in ((0, 300), (2, 280))]
    slower = [_synthetic_job(tmp_path / "b", 0, _series(m, 2, seed=m), job=j) for j, m in ((1, 200), (3, 210))]
    best = rank([faster[0], slower[0], faster[1], slower[1]])
    assert best is faster[0] and best["standing"] == "fastest"


def test_the_sweep_resolution_is_checked_and_documented_once() -> None:
    with pytest.raises(RunEnded) as ended:
        SweepReport(min_gain=1.5)
    assert ended.value.code == 2
    assert ended.value.line.startswith("error: hydra.callbacks.sweep_report.min_gain=1.5: expected a fraction in")
    hydra_conf = yaml.safe_load((ROOT / "conf" / "config.yaml").read_text())["hydra"]
    assert hydra_conf["callbacks"]["sweep_report"]["min_gain"] == MIN_GAIN
    readme = " ".join((ROOT / "README.md").read_text().split())
    assert f"`hydra.callbacks.sweep_report.min_gain` ({MIN_GAIN:.2f}, a {MIN_GAIN:.0%} speed-up, by default" in readme


def test_one_ranked_job_is_not_called_fastest(tmp_path: Path) -> None:
    short = _synthetic_job(tmp_path, 0, [100.0, 110.0, 105.0])
    long = _synthetic_job(tmp_path, 1, _series(200, 5))
    best = rank([short, long])
    assert best is long and long["standing"] == "the only one ranked"
    line = decision([short, long], ["data.num_workers"], best)
    assert line.startswith("Nothing to compare: data.num_workers=1 is the only setting ranked")
    assert "1 other(s) not ranked: too few windows" in line
    fig = plot(None, [short, long], ["data.num_workers"], best)
    rate_ax = next(ax for ax in fig.axes if ax.get_title() == "Throughput")
    assert [text.get_text().split("\n")[0] for text in rate_ax.texts] == ["job 1: the only one ranked"]


def test_a_recommendation_that_changes_the_batch_size_says_it_changes_the_recipe(tmp_path: Path) -> None:
    for job, (batch, mean) in enumerate(((32, 100), (64, 150), (256, 300))):
        windows = _series(mean, 3, seed=job)
        _fake_job(tmp_path, job, [f"data.batch_size={batch}", "data.num_workers=2"], {"rate": mean, "windows": windows})
    best = build_report(tmp_path)
    assert best["overrides"]["data.batch_size"] == "256"
    note = recipe_note(collect(tmp_path)[0], best)
    assert note.startswith("Note: the recommended setting trains with data.batch_size=256 (others: 32, 64)")
    assert "optim.lr x 256/B" in note and "hparams_search=loader" in note
    assert note in (tmp_path / "sweep_summary.md").read_text()
    same = tmp_path / "same"
    for job, workers in enumerate((0, 2)):
        windows = _series(100 + 50 * job, 3, seed=job)
        _fake_job(same, job, ["data.batch_size=64", f"data.num_workers={workers}"], {"rate": 1.0, "windows": windows})
    assert recipe_note(collect(same)[0], build_report(same)) == ""  # one batch size: the loader alone changed


def test_the_loader_search_keeps_the_batch_size_unless_asked() -> None:
    with initialize_config_dir(version_base="1.3", config_dir=str(CONF_DIR)):
        loader = compose("config", overrides=["hparams_search=loader"], return_hydra_config=True).hydra.sweeper
        both = compose("config", overrides=["hparams_search=loader_and_batch"], return_hydra_config=True).hydra.sweeper
    assert "data.batch_size" not in loader.params and "data.batch_size" in both.params
    assert set(loader.params) < set(both.params) and loader.max_failure_rate == both.max_failure_rate == 1.0


@pytest.mark.slow  # a multirun of real train.py processes
def test_an_optuna_trial_too_short_to_measure_is_a_failed_trial_and_the_search_goes_on(
    tmp_path: Path, data_dir: Path
) -> None:
    """Trials of 2 steps (both warm-up: no figure) and of 8, drawn by the search's seeded TPE sampler (its first
    trials are random; this seed draws both). The short ones are recorded as failed trials with their reason,
    the search finishes, Optuna's best is a measured one and the report lists every job."""
    sweep = tmp_path / "sweep"
    args = [
        "hparams_search=loader",
        "hydra.sweeper.sampler.seed=0",
        "hydra.sweeper.n_trials=3",
        "train.max_steps=choice(2,8)",
        *SWEEP,
    ]
    args += ["train.epochs=4", "data.batch_size=32", "data.num_workers=0", "data.pin_memory=false"]
    args += ["data.prefetch_factor=2"]
    result = _sweep(args, sweep, data_dir)
    assert re.search(r"trial \d failed: images_per_sec not measured: ", result.stdout + result.stderr)
    results = (sweep / "optimization_results.yaml").read_text()
    assert "train.max_steps: 8" in results
    rows = _csv_rows(sweep)
    assert len(rows) == 3 and {row["train.max_steps"] for row in rows} == {"2", "8"}
    short = next(row for row in rows if row["train.max_steps"] == "2")
    assert short["images_per_sec"] == "" and "warm-up" in (sweep / "sweep_summary.md").read_text()


@pytest.mark.slow  # a multirun of a real train.py process
@pytest.mark.parametrize("why", ["too short", "failed"])
def test_a_search_with_no_measured_trial_ends_in_the_report_and_one_line(
    tmp_path: Path, data_dir: Path, why: str
) -> None:
    """Optuna has no best trial then, whether each trial was too short to measure or failed: the report is written
    and one line says why (hydra_plugins/imgtrain_optuna), never a traceback."""
    sweep = tmp_path / "sweep"
    args = ["-m", "hparams_search=loader", "hydra.sweeper.n_trials=1", "train.max_steps=2", *SWEEP]
    args += ["data.num_workers=0", "data.pin_memory=false", "data.prefetch_factor=2", f"hydra.sweep.dir={sweep}"]
    args += ["model.arch=no_such_net"] if why == "failed" else []
    result = run_train(args, sweep / "unused", data_dir, timeout=300)
    said = f"{result.stdout[-3000:]}\n{result.stderr[-3000:]}"  # the job's own log is on stdout
    assert result.returncode == 1 and "Traceback" not in result.stderr, said
    line = result.stderr.strip().splitlines()[-1]
    assert line.startswith("error: no trial of the search was measured"), said
    assert (
        "train.max_steps" if why == "too short" else "every job failed, the first with: the job failed: model.arch"
    ) in line
    summary = (sweep / "sweep_summary.md").read_text()
    assert ("warm-up" if why == "too short" else "no_such_net") in summary, summary


def _report_as_the_callback_does(sweep: Path) -> None:
    """The multirun's end, in-process: what Hydra calls after the last job."""
    SweepReport().on_multirun_end(OmegaConf.create({"hydra": {"sweep": {"dir": str(sweep)}}}))


GOOD = {"rate": 100.0, "windows": [99.0, 101.0, 100.0, 98.0, 102.0, 100.0]}
DEEP = "[" * 100_000  # Python's JSON and YAML parsers recurse per level: a RecursionError, not a parse error
# A damaged job file (relative path, text) -> the status and the start of the reason its row shows.
DAMAGE = {
    "malformed YAML": (".hydra/overrides.yaml", "- data.num_workers=2\n- [unclosed\n", "damaged",
                       ".hydra/overrides.yaml cannot be read (not YAML: expected ',' or ']'"),
    "a list of ints": (".hydra/overrides.yaml", "- 1\n- 2\n", "damaged",
                       ".hydra/overrides.yaml: expected a list of key=value overrides, found 1"),
    "YAML nested too deeply": (".hydra/overrides.yaml", DEEP, "damaged",
                               ".hydra/overrides.yaml cannot be read (nested too deeply to parse)"),
    "a rate that is a word": ("metrics.json", json.dumps({**GOOD, "images_per_sec": "fast"}), "damaged",
                              "metrics.json: images_per_sec is 'fast', expected a number or null"),
    "a window that is a word": ("metrics.json", json.dumps({"images_per_sec_windows": [1.0, "x"]}), "damaged",
                                "metrics.json: images_per_sec_windows is [1.0, 'x'], expected a list of numbers"),
    "a loader flag that is a word": ("metrics.json", json.dumps({"loader": {"pin_memory": "yes"}}), "damaged",
                                     "metrics.json: loader.pin_memory is 'yes', expected true or false or null"),
    "a rate no float holds": ("metrics.json", json.dumps({**GOOD, "images_per_sec": 10**400}), "damaged",
                              "metrics.json: images_per_sec is 1000000000000000000000000000000000000..."),
    "an integer too long to parse": ("metrics.json", '{"images_per_sec": ' + "1" * 5000 + "}", "damaged",
                                     "metrics.json cannot be read (not valid JSON: Exceeds the limit"),
    "JSON nested too deeply": ("metrics.json", DEEP, "damaged",
                               "metrics.json cannot be read (nested too deeply to parse)"),
    "a failure record nested too deeply": ("failed.json", DEEP, "failed",
                                           "failed.json cannot be read (nested too deeply to parse)"),
}  # fmt: skip


@pytest.mark.parametrize("case", DAMAGE)
def test_one_damaged_job_marks_its_row_and_the_report_goes_on(case: str, tmp_path: Path, capsys) -> None:
    """Each of these lost the whole report ("could not build the sweep report", no sweep_summary.md)."""
    name, text, status, reason = DAMAGE[case]
    _fake_job(tmp_path, 0, ["data.num_workers=0"], dict(GOOD))
    _fake_job(tmp_path, 1, ["data.num_workers=1"], {"rate": 200.0, "windows": [w * 2 for w in GOOD["windows"]]})
    _fake_job(tmp_path, 2, ["data.num_workers=2"], dict(GOOD) if name != "failed.json" else None)
    (tmp_path / "2" / name).write_text(text)
    _report_as_the_callback_does(tmp_path)
    rows = _csv_rows(tmp_path)
    assert [row["status"] for row in rows] == ["ok", "ok", status]
    assert rows[2]["reason"].startswith(reason), rows[2]["reason"]
    markdown = (tmp_path / "sweep_summary.md").read_text()
    assert "Fastest here: data.num_workers=1 at 200.0 images/s" in markdown
    assert (tmp_path / "sweep_summary.png").stat().st_size > 0
    out = capsys.readouterr().out
    assert f"{status.upper()}: {reason}" in out and "Recursion" not in out


def _pin_sweep(sweep: Path, rates: tuple[float, float], pinned: tuple[bool, bool]) -> None:
    """data.pin_memory=true,false as Hydra writes the overrides, each job's metrics.json recording what its loader
    used (`pinned`); the pinned-as-written job has the lower memory peak, as in the issue's CPU sweep."""
    for num, (written, rate, used, pss) in enumerate(zip(("True", "False"), rates, pinned, (0.85, 0.99), strict=True)):
        windows = _series(rate, rate * 0.05, seed=num)
        loader = {"num_workers": 1, "pin_memory": used, "prefetch_factor": 2, "persistent_workers": True}
        metrics = {"rate": rate, "windows": windows, "loader": loader, "pss_peak_gb": pss}
        _fake_job(sweep, num, [f"data.pin_memory={written}", "debug=fast"], metrics)


@pytest.mark.parametrize("rates", [(200.0, 200.0), (366.8, 137.9)], ids=["tied", "apart by noise"])
def test_a_setting_the_device_ignored_is_never_recommended(rates: tuple[float, float], tmp_path: Path) -> None:
    """On a CPU both jobs run unpinned ("data.pin_memory=true has no effect on cpu: using false"). The report
    recommended data.pin_memory=True: on the tie by its lower memory peak, and as "Fastest here" when the
    machine's noise set the two apart (366.8 and 137.9 images/s: a real sweep on the 2-core machine)."""
    _pin_sweep(tmp_path, rates, pinned=(False, False))
    best = build_report(tmp_path)
    assert best is not None and best["overrides"]["data.pin_memory"] == "False"
    line = next(line for line in (tmp_path / "sweep_summary.md").read_text().splitlines() if "Recommended" in line)
    assert line.startswith(
        "Tied within noise: data.pin_memory=True, data.pin_memory=False (their intervals overlap, they ran with the "
        "same effective settings, or they differ by less than the sweep's resolution"
    )
    assert "Recommended: data.pin_memory=False, the cheapest of them" in line
    assert line.endswith(
        "data.pin_memory had no effect here: data.pin_memory=True and data.pin_memory=False ran with the same "
        "effective settings (pin_memory=false), so the cheaper value as written is recommended."
    )
    rows = _csv_rows(tmp_path)
    assert [row["standing"] for row in rows] == (["tied", "recommended: cheapest of a tie"])
    notes = " ".join(row["confidence"] for row in rows)
    assert re.search(
        r"tied: it ran with the same effective settings as job [01] \(data.pin_memory had no effect", notes
    )


def test_a_setting_the_device_ignored_is_not_recommended_when_noise_split_its_twins(tmp_path: Path) -> None:
    """pin_memory=true,false x num_workers=0,1 on a CPU: the machine's noise put the unpinned 0-worker job apart
    from a tie that holds its pinned twin. Twins are tied together, so the cheapest is still the unpinned one."""
    loader = {"num_workers": 0, "pin_memory": False, "prefetch_factor": None, "persistent_workers": None}
    for job, (workers, pin, rate) in enumerate([(0, "True", 195.0), (0, "False", 100.0), (1, "True", 200.0),
                                                (1, "False", 200.0)]):  # fmt: skip
        used = {
            **loader,
            "num_workers": workers,
            **({"prefetch_factor": 2, "persistent_workers": True} if workers else {}),
        }
        metrics = {"rate": rate, "windows": _series(rate, rate * 0.03, seed=job), "loader": used, "pss_peak_gb": 1.0}
        _fake_job(tmp_path, job, [f"data.num_workers={workers}", f"data.pin_memory={pin}"], metrics)
    best = build_report(tmp_path)
    assert best is not None and best["job"] == "1"
    line = next(line for line in (tmp_path / "sweep_summary.md").read_text().splitlines() if "Recommended" in line)
    assert "Recommended: data.num_workers=0 data.pin_memory=False, the cheapest of them" in line
    assert line.endswith(
        "data.pin_memory had no effect here: data.pin_memory=True and data.pin_memory=False ran with the same "
        "effective settings (pin_memory=false), so the cheaper value as written is recommended."
    )


def test_a_setting_that_took_effect_is_ranked_as_measured(tmp_path: Path) -> None:
    """The same figures on CUDA, where the pinned job ran pinned: it is the fastest, separated from the other."""
    _pin_sweep(tmp_path, (366.8, 137.9), pinned=(True, False))
    best = build_report(tmp_path)
    assert best is not None and best["overrides"]["data.pin_memory"] == "True" and best["standing"] == "fastest"
    assert "had no effect" not in (tmp_path / "sweep_summary.md").read_text()


OTHER_UID = 4242 if os.geteuid() != 4242 else 4243  # a user other than the one running the tests


def _foreign_link(link: Path, target: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A symbolic link at `link` to `target`, owned by another user as a planted one would be: root gives it away
    (os.lchown); any other user is told it is someone else (os.geteuid), which is all the report can ask."""
    link.symlink_to(target)
    try:
        os.lchown(link, OTHER_UID, OTHER_UID)
    except PermissionError:
        monkeypatch.setattr(os, "geteuid", lambda: link.lstat().st_uid + 1)
    return link


@pytest.mark.parametrize("name", ["sweep_summary.md", "sweep_summary.csv", "sweep_summary.png"])
def test_the_report_never_writes_through_another_users_link(
    name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, capsys
) -> None:
    """A link another user planted at one of the report's names: none of its files is written, one line says why,
    the console summary still ends the sweep, and what the link points at is untouched."""
    sweep, victim = tmp_path / "sweep", tmp_path / "victim"
    victim.write_text("precious\n")
    _fake_job(sweep, 0, ["data.num_workers=0"], dict(GOOD))
    link = _foreign_link(sweep / name, victim, monkeypatch)
    with caplog.at_level(logging.ERROR, logger="imgtrain.sweep.report"):
        _report_as_the_callback_does(sweep)
    assert victim.read_text() == "precious\n" and link.is_symlink()
    assert not [path for path in sweep.iterdir() if path.name.startswith(("sweep_summary", ".sweep_summary"))][1:]
    (record,) = caplog.records
    line = record.getMessage()
    assert line.startswith(f"the sweep report's files are not written: {link} is a symbolic link owned by "), line
    assert f"uid {link.lstat().st_uid}" in line and "pass another hydra.sweep.dir" in line and "\n" not in line
    assert "Nothing to compare" in capsys.readouterr().out


def test_the_report_never_writes_through_another_users_link_behind_its_own(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The sweep's own link to a shared folder, where another user put a link at the name it points to."""
    sweep, shared, victim = tmp_path / "sweep", tmp_path / "shared", tmp_path / "victim"
    shared.mkdir()
    victim.write_text("precious\n")
    _fake_job(sweep, 0, ["data.num_workers=0"], dict(GOOD))
    (sweep / "sweep_summary.md").symlink_to(shared / "sweep_summary.md")
    planted = _foreign_link(shared / "sweep_summary.md", victim, monkeypatch)
    build_report(sweep)
    assert victim.read_text() == "precious\n" and planted.is_symlink()
    assert not (sweep / "sweep_summary.csv").exists()  # none of the three, as for a link at the name itself


def test_the_report_follows_its_users_own_links(tmp_path: Path) -> None:
    """The report's files linked by the sweep's own user (to a shared folder, say): written there, links kept."""
    sweep, shared = tmp_path / "sweep", tmp_path / "shared"
    shared.mkdir()
    _fake_job(sweep, 0, ["data.num_workers=0"], dict(GOOD))
    for name in ("sweep_summary.md", "sweep_summary.csv", "sweep_summary.png"):
        (sweep / name).symlink_to(shared / name)
    build_report(sweep)
    assert all((sweep / name).is_symlink() for name in ("sweep_summary.md", "sweep_summary.csv", "sweep_summary.png"))
    assert "Nothing to compare: data.num_workers=0" in (shared / "sweep_summary.md").read_text()
    assert _csv_rows(shared)[0]["status"] == "ok"
    with Image.open(shared / "sweep_summary.png") as image:
        assert image.format == "PNG"


def _engine_job(sweep: Path, num: int, engine: str, workers: int, pss: float, **kw: Any) -> None:
    """A finished job of `-m data.engine=dataloader,threads data.num_workers=...` at 200 images/s (3% noise: every
    job tied). As data/loader.py records it: threads keep 2 batches each in flight and report persistent_workers
    false; `ran`, the engine the run used where it differs from the one written; `stall`, the epoch-start share."""
    used, stall = kw.pop("ran", engine), kw.pop("stall", None)
    loader = {"num_workers": workers, "pin_memory": False, "prefetch_factor": 2, "persistent_workers": False}
    metrics = {"rate": 200.0, "windows": _series(200.0, 6.0, seed=num), "pss_peak_gb": pss}
    metrics["loader"] = {**loader, "engine": used, **kw}
    if stall is not None:  # seconds per later epoch start: 0.5 and 0.7 s, median 0.6
        metrics |= {"epoch_start_cost_frac": stall, "epoch_start_cost_s": [0.5, 0.7]}
    _fake_job(sweep, num, [f"data.engine={engine}", f"data.num_workers={workers}"], metrics)


def test_the_table_shows_each_jobs_engine_memory_and_epoch_start_beside_its_throughput(tmp_path: Path, capsys) -> None:
    from imgtrain.sweep.report import table

    for num, (engine, workers, pss, stall) in enumerate([("dataloader", 1, 1.6, 0.12), ("threads", 1, 1.0, 0.01)]):
        _engine_job(tmp_path / "swept", num, engine, workers, pss, stall=stall)
    build_report(tmp_path / "swept")
    header = (tmp_path / "swept" / "sweep_summary.md").read_text().splitlines()[0]
    assert "| data.engine | status | images_per_sec |" in header  # the swept column says the engine: no second one
    assert (
        "| images_per_sec_p75 | pss_peak_gb | epoch_start_cost_frac | epoch_start_cost_s | data_wait_frac |" in header
    )
    rows = _csv_rows(tmp_path / "swept")
    assert [(r["data.engine"], r["pss_peak_gb"], r["epoch_start_cost_frac"]) for r in rows] == [
        ("dataloader", "1.600", "0.120"),
        ("threads", "1.000", "0.010"),
    ]
    assert [r["epoch_start_cost_s"] for r in rows] == ["0.600", "0.600"] and "engine" not in rows[0]
    assert "PSS 1.00 GB  epoch start 0.60 s (1.0% of an epoch)" in capsys.readouterr().out
    # every job wrote data.engine=threads (not swept), and one had no workers to run threads with: an engine column
    _engine_job(tmp_path / "fixed", 0, "threads", 0, 1.0, ran="dataloader")
    _engine_job(tmp_path / "fixed", 1, "threads", 2, 1.0)
    _fake_job(tmp_path / "fixed", 2, ["data.engine=threads", "data.num_workers=3"], None)  # failed: no engine
    header, cells = table(*collect(tmp_path / "fixed"))
    assert [row[header.index("engine")] for row in cells] == ["dataloader", "threads", ""]
    assert "engine" in header[header.index("images_per_sec_p75") :][:2]
    _fake_job(tmp_path / "old", 0, ["data.num_workers=0"], {"rate": 90.0, "windows": [90.0] * 6})  # no loader
    rows, swept = collect(tmp_path / "old")
    assert rows[0]["engine"] == "dataloader"  # the only engine before data.engine
    assert not {"engine", "pss_peak_gb", "epoch_start_cost_frac", "epoch_start_cost_s"} & set(table(rows, swept)[0])


def test_a_tie_between_engines_goes_to_the_lower_memory_then_to_threads(tmp_path: Path) -> None:
    """Memory beyond noise decides whichever engine has it; within noise, today's order; then threads. A threads
    run neither wins nor loses on persistent_workers, which threads do not have."""
    sweeps = {
        "threads lighter": ([1.6, 1.6, 1.0, 1.1], "threads", 1),
        "workers lighter": ([1.0, 1.1, 1.6, 1.6], "dataloader", 1),
        "more threads lighter": ([1.6, 1.6, 1.5, 1.0], "threads", 2),
        "within noise": ([1.00, 1.02, 1.04, 0.98], "threads", 1),
    }
    for name, (peaks, engine, workers) in sweeps.items():
        jobs = [("dataloader", 1), ("dataloader", 2), ("threads", 1), ("threads", 2)]
        for num, ((kind, count), pss) in enumerate(zip(jobs, peaks, strict=True)):
            _engine_job(tmp_path / name, num, kind, count, pss)
        rows, swept = collect(tmp_path / name)
        best = rank(rows)
        assert (best["engine"], best["workers"], best["standing"]) == (
            engine,
            workers,
            "recommended: cheapest of a tie",
        )
    line = decision(rows, swept, best)
    assert "Recommended: data.engine=threads data.num_workers=1, the cheapest of them (pin_memory=false, then " in line
    assert "fewest workers (threads or processes alike)" in line and "then threads over worker processes, among" in line

    def job(name: str, kind: str, pss: float, **loader: Any) -> dict:
        _engine_job(tmp_path / name, 0, kind, 1, pss, **loader)
        return read_job(tmp_path / name / "0")

    kept, threads = job("kept", "dataloader", 1.0, persistent_workers=True), job("t", "threads", 1.0)
    assert cheapest([kept, threads]) is threads
    fresh, claimed = job("fresh", "dataloader", 1.0), job("claimed", "threads", 1.0, persistent_workers=True)
    assert cheapest([fresh, claimed]) is claimed  # persistent_workers=true on a threads row costs nothing
    unpinned, pinned = job("unpinned", "dataloader", 1.0), job("pinned", "threads", 1.0, pin_memory=True)
    assert cheapest([pinned, unpinned]) is unpinned  # pinned memory still comes first


def test_threads_without_workers_ran_as_the_dataloader_and_tie_with_it(tmp_path: Path) -> None:
    """data.engine=threads with num_workers=0 runs no threads (the loader records engine dataloader): the two
    jobs ran alike, and the decision line says data.engine had no effect."""
    _engine_job(tmp_path, 0, "dataloader", 0, 1.0, prefetch_factor=None, persistent_workers=None)
    _engine_job(tmp_path, 1, "threads", 0, 1.05, ran="dataloader", prefetch_factor=None, persistent_workers=None)
    rows, swept = collect(tmp_path)
    best = rank(rows)
    notes = " ".join(row["confidence"] for row in rows)
    assert re.search(r"tied: it ran with the same effective settings as job [01] \(data.engine had no effect", notes)
    line = decision(rows, swept, best)
    assert best["overrides"]["data.engine"] == "dataloader"  # an engine that had no effect is no reason to change
    assert "data.engine had no effect here" in line and '(engine="dataloader"), so the cheaper value' in line
