"""Sweeps that end with a report: summary files, a plot, failed jobs as rows, ceiling modes, Optuna search."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest
from helpers import FAST, compose_cfg, run_train
from PIL import Image

from imgtrain.metrics import report
from imgtrain.run import run
from imgtrain.sweep_report import rank, read_job

SWEEP = list(FAST)  # the sweeps override data.num_workers


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
    assert "Fastest: job" in markdown
    with Image.open(sweep / "sweep_summary.png") as image:
        assert image.format == "PNG" and image.size[0] > 400
    assert "Fastest here: data.num_workers=" in result.stdout
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


@pytest.mark.parametrize("mode", ["loader", "compute"])
def test_ceiling_modes(tmp_path: Path, mode: str) -> None:
    overrides = [
        "dataset=synthetic",
        "dataset.image_size=32",
        "dataset.num_train=128",
        "dataset.num_val=16",
        "data.batch_size=16",
        "data.num_workers=0",
        "trainer.max_steps=6",
        "trainer.warmup_steps=1",
        "trainer.log_every_n_steps=2",
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
    args = ["hparams_search=loader", "hydra.sweeper.n_trials=3", "trainer.max_steps=8", *SWEEP]
    args += ["trainer.epochs=4", "data.batch_size=32"]
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


def test_rank_flags_overlap_and_noise(tmp_path: Path) -> None:
    def job(num: int, windows: list[float]) -> dict:
        folder = tmp_path / str(num)
        (folder / ".hydra").mkdir(parents=True)
        (folder / ".hydra" / "overrides.yaml").write_text(f"- data.num_workers={num}\n")
        metrics = {
            "images_per_sec": sum(windows) / len(windows),
            "images_per_sec_median": sorted(windows)[2],
            "images_per_sec_windows": windows,
            "data_wait_frac": 0.1,
            "mode": "train",
        }
        (folder / "metrics.json").write_text(json.dumps(metrics))
        return read_job(folder)

    steady, close, noisy = (
        job(0, [100, 101, 100, 99, 100]),
        job(1, [99, 100, 99, 100, 98]),
        job(2, [40, 90, 60, 20, 80]),
    )
    best = rank([steady, close, noisy])
    assert best is steady and steady["confidence"] == ""
    assert "overlaps the fastest" in close["confidence"]
    assert "noisy" in noisy["confidence"]


def test_ceilings_line_names_the_limit() -> None:
    from imgtrain.sweep_report import ceilings

    def row(mode: str, rate: float) -> dict:
        return {"status": "ok", "mode": mode, "images_per_sec": rate}

    line = ceilings([row("loader", 300.0), row("compute", 900.0), row("train", 270.0)])
    assert "input-bound" in line and "300.0" in line and "90%" in line
    assert "compute-bound" in ceilings([row("loader", 3000.0), row("compute", 900.0)])
    assert ceilings([row("train", 270.0)]) == ""


def test_the_plot_is_drawn_for_one_window_and_for_a_job_without_a_figure(tmp_path: Path) -> None:
    """A short sweep: one steady window per job (the median unrounded, the window rounded in metrics.json) and a
    job too short for any window. It used to end with "'yerr' must not contain negative values" and no PNG."""
    from imgtrain.sweep_report import build_report

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
    best = build_report(tmp_path)
    assert best["job"] == "0"
    assert (tmp_path / "sweep_summary.png").stat().st_size > 0
