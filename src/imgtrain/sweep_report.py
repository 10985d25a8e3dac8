"""The sweep report: a Hydra Callback that ends a multirun with a table, a plot and the fastest setting.

It reads what each job left in its directory (`.hydra/overrides.yaml`, `metrics.json` or `failed.json`), so it
works the same with the basic launcher and with submitit, and a failed job becomes a row, not a lost sweep.
"""

from __future__ import annotations

import csv
import json
import logging
import statistics
from pathlib import Path
from typing import Any

import yaml
from hydra.experimental.callback import Callback
from omegaconf import DictConfig

from imgtrain.dist import global_rank

log = logging.getLogger(__name__)

METRIC_COLUMNS = (
    "images_per_sec",
    "images_per_sec_median",
    "images_per_sec_p25",
    "images_per_sec_p75",
    "data_wait_frac",
    "gpu_util_mean",
    "cpu_pct_mean",
    "rss_peak_gb",
    "val_acc",
)
# A job whose middle half of window throughputs spans more than this share of its median is too noisy to rank.
NOISY_SPREAD = 0.15


def _overrides(job_dir: Path) -> dict[str, str]:
    path = job_dir / ".hydra" / "overrides.yaml"
    entries = yaml.safe_load(path.read_text()) if path.exists() else []
    return dict(entry.split("=", 1) for entry in entries or [] if "=" in entry and not entry.startswith("hydra"))


def _quartiles(values: list[float]) -> tuple[float | None, float | None]:
    if len(values) < 2:
        return (values[0], values[0]) if values else (None, None)
    q = statistics.quantiles(values, n=4, method="inclusive")
    return q[0], q[2]


def read_job(job_dir: Path) -> dict[str, Any]:
    """One row: the job's overrides, its status, and its figures (empty when it failed)."""
    row: dict[str, Any] = {"job": job_dir.name, "overrides": _overrides(job_dir)}
    metrics_path, failed_path = job_dir / "metrics.json", job_dir / "failed.json"
    if metrics_path.exists():
        metrics = json.loads(metrics_path.read_text())
        row["status"], row["reason"] = "ok", ""
        row.update({key: metrics.get(key) for key in METRIC_COLUMNS})
        row["images_per_sec_p25"], row["images_per_sec_p75"] = _quartiles(metrics.get("images_per_sec_windows") or [])
        row["verdict"] = metrics.get("verdict", "")
        row["mode"] = metrics.get("mode", "train")
    else:
        reason = "no metrics.json: the job was killed or crashed before it finished"
        if failed_path.exists():
            reason = json.loads(failed_path.read_text()).get("error", reason)
        row["status"], row["reason"], row["verdict"], row["mode"] = "failed", reason, "", ""
        row.update({key: None for key in METRIC_COLUMNS})
    return row


def collect(sweep_dir: Path) -> tuple[list[dict[str, Any]], list[str]]:
    """Every job's row (in job order) and the keys whose values differ between jobs (the swept keys)."""
    jobs = sorted((p for p in sweep_dir.iterdir() if p.is_dir() and p.name.isdigit()), key=lambda p: int(p.name))
    rows = [read_job(job) for job in jobs]
    keys: list[str] = []
    for row in rows:
        keys += [k for k in row["overrides"] if k not in keys]
    swept = [k for k in keys if len({row["overrides"].get(k) for row in rows}) > 1] or keys
    return rows, swept


def rank(rows: list[dict[str, Any]]) -> dict[str, Any] | None:
    """Mark noisy jobs and jobs indistinguishable from the fastest; return the fastest ok row."""
    ok = [row for row in rows if row["status"] == "ok" and row["images_per_sec"]]
    if any(row["mode"] == "train" for row in ok):  # the ceiling modes are yardsticks, not settings to pick
        ok = [row for row in ok if row["mode"] == "train"]
    if not ok:
        return None
    best = max(ok, key=lambda row: row["images_per_sec"])  # the figure run() returns to a sweeper
    for row in rows:
        notes = []
        median, p25, p75 = row["images_per_sec_median"], row["images_per_sec_p25"], row["images_per_sec_p75"]
        if median and p25 is not None and (p75 - p25) / median > NOISY_SPREAD:
            notes.append(f"noisy: middle half of windows spans {(p75 - p25) / median:.0%} of the median")
        best_p25 = best["images_per_sec_p25"]
        if row is not best and row in ok and p75 is not None and best_p25 is not None and p75 >= best_p25:
            notes.append("overlaps the fastest: not confidently slower")
        row["confidence"] = "; ".join(notes)
    return best


def _cell(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, float):
        return f"{value:.3f}" if abs(value) < 10 else f"{value:.1f}"
    return str(value)


def table(rows: list[dict[str, Any]], swept: list[str]) -> tuple[list[str], list[list[str]]]:
    """Header and cells shared by the CSV and the markdown table."""
    header = ["job", *swept, "status", *METRIC_COLUMNS, "verdict", "confidence", "reason"]
    cells = [
        [row["job"], *[row["overrides"].get(k, "") for k in swept], row["status"]]
        + [_cell(row[k]) for k in METRIC_COLUMNS]
        + [row.get("verdict", ""), row.get("confidence", ""), row["reason"]]
        for row in rows
    ]
    return header, cells


def write_reports(sweep_dir: Path, rows: list[dict[str, Any]], swept: list[str], best: dict | None) -> None:
    """sweep_summary.csv, sweep_summary.md and sweep_summary.png in the sweep directory."""
    header, cells = table(rows, swept)
    with open(sweep_dir / "sweep_summary.csv", "w", newline="") as f:
        csv.writer(f).writerows([header, *cells])
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(c.replace("|", "/") for c in row) + " |" for row in cells]
    if ceilings(rows):
        lines += ["", ceilings(rows)]
    if best is not None:
        lines += ["", f"Fastest: job {best['job']} ({_describe(best, swept)}), {best['images_per_sec']:.1f} images/s."]
        lines += [f"Reproduce: `{reproduce_command(best)}`"]
    (sweep_dir / "sweep_summary.md").write_text("\n".join(lines) + "\n")
    plot(sweep_dir / "sweep_summary.png", rows, swept)


def _describe(row: dict[str, Any], swept: list[str]) -> str:
    return " ".join(f"{k}={row['overrides'].get(k, '')}" for k in swept)


def reproduce_command(row: dict[str, Any]) -> str:
    """A single-run command with the job's settings (a search's own config group left out)."""
    kept = (f"{k}={v}" for k, v in row["overrides"].items() if k != "hparams_search")
    return " ".join(["python train.py", *kept])


def _as_number(value: str) -> float | None:
    try:
        return float(value)
    except (TypeError, ValueError):
        return None


def plot(path: Path, rows: list[dict[str, Any]], swept: list[str]) -> None:
    """Throughput (median, with the middle half of windows) and data wait against the first swept key."""
    import matplotlib

    matplotlib.use("Agg")  # no display needed
    import matplotlib.pyplot as plt

    x_key, series_keys = (swept[0], swept[1:]) if swept else ("job", [])
    fig, (ax_rate, ax_wait) = plt.subplots(1, 2, figsize=(11, 4.2))
    groups: dict[str, list[dict[str, Any]]] = {}
    for row in rows:
        if row["status"] == "ok" and (row["images_per_sec_median"] or row["images_per_sec"]):  # n/a: not plotted
            groups.setdefault(_describe(row, series_keys) or "all jobs", []).append(row)
    for label, members in groups.items():
        xs_raw = [row["overrides"].get(x_key, row["job"]) for row in members]
        numeric = all(_as_number(x) is not None for x in xs_raw)
        xs = [_as_number(x) if numeric else str(x) for x in xs_raw]
        order = sorted(range(len(xs)), key=lambda i: xs[i]) if numeric else range(len(xs))
        xs = [xs[i] for i in order]
        members = [members[i] for i in order]
        rates = [row["images_per_sec_median"] or row["images_per_sec"] for row in members]
        # Clamped at 0: the quartiles come from metrics.json's windows, rounded to 0.01 img/s, the median from the
        # unrounded ones; with one window the rounding alone made a negative bar and matplotlib refused the plot.
        low = [max(0.0, rate - (row["images_per_sec_p25"] or rate)) for rate, row in zip(rates, members, strict=True)]
        high = [max(0.0, (row["images_per_sec_p75"] or rate) - rate) for rate, row in zip(rates, members, strict=True)]
        ax_rate.errorbar(xs, rates, yerr=[low, high], marker="o", capsize=3, label=label)
        ax_wait.plot(xs, [100 * (row["data_wait_frac"] or 0) for row in members], marker="o", label=label)
    ax_rate.set(xlabel=x_key, ylabel="images/s (median of windows)", title="Throughput")
    ax_wait.set(xlabel=x_key, ylabel="% of step time waiting for data", title="Data wait")
    ax_wait.set_ylim(bottom=0)
    xs_all = [_as_number(row["overrides"].get(x_key)) for row in rows if row["status"] == "ok"]
    for ax in (ax_rate, ax_wait):
        if xs_all and all(x is not None for x in xs_all):
            ax.set_xticks(sorted(set(xs_all)))
        ax.grid(alpha=0.3)
        if len(groups) > 1:
            ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def ceilings(rows: list[dict[str, Any]]) -> str:
    """With mode=loader and mode=compute jobs in the sweep: which ceiling bounds training, in one line."""
    fastest = {}
    for row in rows:
        if row["status"] == "ok" and row["images_per_sec"]:
            fastest[row["mode"]] = max(fastest.get(row["mode"], 0.0), row["images_per_sec"])
    if "loader" not in fastest or "compute" not in fastest:
        return ""
    loader, compute = fastest["loader"], fastest["compute"]
    bound = "input-bound: the input pipeline" if loader < compute else "compute-bound: the model"
    line = f"Ceilings: input pipeline {loader:.1f} images/s, compute {compute:.1f} images/s -> {bound} is the limit"
    if "train" in fastest:
        line += f"; training reached {fastest['train']:.1f} images/s ({fastest['train'] / min(loader, compute):.0%})"
    return line


def print_summary(rows: list[dict[str, Any]], swept: list[str], best: dict | None, sweep_dir: Path) -> None:
    """The console end of a sweep: one line per job, then the fastest setting and how to reproduce it."""
    print(f"\nSweep report ({len(rows)} jobs) in {sweep_dir}")
    for row in rows:
        if row["status"] == "ok":
            rate, wait = row["images_per_sec"] or 0.0, row["data_wait_frac"] or 0.0
            figures = f"{rate:9.1f} img/s  data wait {wait:6.1%}"
        else:
            figures = f"FAILED: {row['reason']}"
        print(f"  job {row['job']:>3}  {_describe(row, swept):<40} {figures}  {row.get('confidence', '')}")
    if ceilings(rows):
        print(ceilings(rows))
    if best is None:
        print("No job finished with a throughput figure.\n")
        return
    print(f"Fastest here: {_describe(best, swept)} at {best['images_per_sec']:.1f} images/s")
    if best.get("verdict"):
        print(f"  {best['verdict']}")
    print(f"Reproduce it: {reproduce_command(best)}\n", flush=True)


def build_report(sweep_dir: Path) -> dict[str, Any] | None:
    """Collect, rank, write and print; returns the fastest row (None when no job finished)."""
    rows, swept = collect(sweep_dir)
    if not rows:
        return None
    best = rank(rows)
    write_reports(sweep_dir, rows, swept, best)
    print_summary(rows, swept, best, sweep_dir)
    return best


class SweepReport(Callback):
    """Hydra callback: after the last job of a multirun, write and print the sweep report."""

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        if global_rank() != 0:  # inside torchrun every rank runs the sweep; one report is enough
            return
        try:
            build_report(Path(config.hydra.sweep.dir))
        except Exception as error:  # the jobs' own results are on disk whatever happens here
            log.error("could not build the sweep report: %s", error)
