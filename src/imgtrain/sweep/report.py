"""The sweep report: a Hydra Callback that ends a multirun with a table, a plot and the fastest setting.

It reads what each job left in its directory (sweep/jobs.py), so it works the same with the basic launcher and
with submitit, and a failed or damaged job becomes a row, not a lost sweep.
"""

from __future__ import annotations

import csv
import io
import logging
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig

from imgtrain.common.errors import EXIT_BAD_INPUT, RunEnded, RunError
from imgtrain.common.links import refuse_foreign_links
from imgtrain.host.dist import global_rank
from imgtrain.metrics.spread import Rate, indistinguishable
from imgtrain.sweep.files import write_file
from imgtrain.sweep.jobs import (
    COST_COLUMNS,
    DAMAGED,
    METRIC_COLUMNS,
    OPTIONAL_COLUMNS,
    THROUGHPUT_COLUMNS,
    collect,
    read_job,  # noqa: F401 - imported from here before sweep/jobs.py held it
)
from imgtrain.sweep.plot import describe, plot
from imgtrain.sweep.rank import DATALOADER, ENGINE_KEY, MIN_GAIN, decision, drift, rank
from imgtrain.sweep.settings import REPEAT_KEY, setting_of

log = logging.getLogger(__name__)

# The median window rate, its 95% interval, and where the job stands: fastest, slower, tied, recommended, not ranked.
SPREAD_COLUMNS = ("interval_low", "interval_high", "standing")
# The `environment` keys that make two jobs' figures not comparable when they differ.
MACHINE_KEYS = ("hostname", "gpu_name", "torch", "cpus_available")


BATCH_KEY = "data.batch_size"  # part of the training recipe: a sweep over it says so (recipe_note)


def _cell(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, float):
        return f"{value:.3f}" if abs(value) < 10 else f"{value:.1f}"
    return str(value)


def table(rows: list[dict[str, Any]], swept: list[str]) -> tuple[list[str], list[list[str]]]:
    """Header and cells shared by the CSV and the markdown table (`ran_on` only when the machines differ): what
    each setting costs (COST_COLUMNS) beside its throughput, the optional columns only when some job has them."""
    optional = [k for k in OPTIONAL_COLUMNS if any(row.get(k) is not None for row in rows)]
    optional = [k for k in optional if k != "engine" or engine_column(rows, swept)]
    costs = [k for k in optional if k in COST_COLUMNS]
    others = [k for k in optional if k not in COST_COLUMNS]
    metrics = [*THROUGHPUT_COLUMNS, *costs, *(k for k in METRIC_COLUMNS if k not in THROUGHPUT_COLUMNS)]
    machine = ["ran_on"] if machine_differences(rows) else []
    header = ["job", *swept, *machine, "status", *metrics, *SPREAD_COLUMNS, *others, "verdict"]
    header += ["confidence", "reason"]
    cells = [
        [row["job"], *[row["overrides"].get(k, "") for k in swept]]
        + [_machine(row) for _ in machine]
        + [row["status"], *[_cell(row.get(k)) for k in (*metrics, *SPREAD_COLUMNS, *others)]]
        + [row.get("verdict", ""), row.get("confidence", ""), row["reason"]]
        for row in rows
    ]
    return header, cells


def engine_column(rows: list[dict[str, Any]], swept: list[str]) -> bool:
    """Whether the table needs an `engine` column: some job ran another engine than its columns say (its
    data.engine as written when that is swept, else the default dataloader), as data.engine=threads does without
    workers (dataloader) or when every job of the sweep wrote it (no swept column)."""

    def said(row: dict[str, Any]) -> str:
        return str(row["overrides"].get(ENGINE_KEY, DATALOADER)).lower() if ENGINE_KEY in swept else DATALOADER

    return any(row.get("engine") not in (None, said(row)) for row in rows)


def _costs(row: dict[str, Any], engine: bool) -> str:
    """The console's cost figures of a finished job: its engine (when the table shows it), PSS peak, epoch start."""
    parts = [f"engine {row['engine']}"] if engine and row.get("engine") else []
    if row.get("pss_peak_gb") is not None:
        parts.append(f"PSS {row['pss_peak_gb']:.2f} GB")
    share, seconds = row.get("epoch_start_cost_frac"), row.get("epoch_start_cost_s")
    if share is not None or seconds is not None:
        in_s = f"{seconds:.2f} s" if seconds is not None else ""
        of_epoch = f"{share:.1%} of an epoch" if share is not None else ""
        parts.append("epoch start " + (f"{in_s} ({of_epoch})" if in_s and of_epoch else in_s or of_epoch))
    return "  ".join(parts)


def ran_on(environment: dict[str, Any]) -> str:
    """The machine and versions a job ran on, in words (every key optional)."""
    env = {k: v for k, v in environment.items() if v not in (None, "")}
    parts = [
        f"host {env['hostname']}" if "hostname" in env else "",
        str(env.get("gpu_name", "")),
        f"CUDA {env['cuda']}" if "cuda" in env else "",
        f"driver {env['driver']}" if "driver" in env else "",
        f"torch {env['torch']}" if "torch" in env else "",
        f"torchvision {env['torchvision']}" if "torchvision" in env else "",
        f"{env['cpus_available']} CPUs available" if "cpus_available" in env else "",
    ]
    return ", ".join(part for part in parts if part)


def machine_differences(rows: list[dict[str, Any]]) -> dict[str, list[str]]:
    """The machine keys whose values differ between the finished jobs that recorded an environment."""
    envs = [row["environment"] for row in rows if row["status"] == "ok" and row.get("environment")]
    differences = {}
    for key in MACHINE_KEYS:
        values = list(dict.fromkeys(str(env.get(key)) for env in envs))
        if len(values) > 1:
            differences[key] = values
    return differences


def _machine(row: dict[str, Any]) -> str:
    env = row.get("environment") or {}
    return " ".join(f"{key}={env[key]}" for key in MACHINE_KEYS if env.get(key) is not None)


def machine_lines(rows: list[dict[str, Any]]) -> list[str]:
    """The line "Ran on: ..." (the first finished job's environment) and a warning when the machines differ."""
    first = next((row["environment"] for row in rows if row["status"] == "ok" and row.get("environment")), None)
    lines = [f"Ran on: {ran_on(first)}"] if first and ran_on(first) else []
    differences = machine_differences(rows)
    if differences:
        what = "; ".join(f"{key}: {', '.join(values)}" for key, values in differences.items())
        lines.append(f"Warning: the jobs ran on different machines ({what}): the comparison is not like for like.")
    return lines


SUMMARY_FILES = ("sweep_summary.csv", "sweep_summary.md", "sweep_summary.png")


def write_reports(sweep_dir: Path, rows: list[dict[str, Any]], swept: list[str], best: dict | None) -> None:
    """sweep_summary.csv, sweep_summary.md and sweep_summary.png in the sweep directory, each written whole; none
    of them when a link another user planted holds one of their names (RunError, one line)."""
    # links at those names, and behind this user's own there, checked before any is written: all three or none
    refuse_foreign_links(sweep_dir, *SUMMARY_FILES, key="hydra.sweep.dir")
    header, cells = table(rows, swept)
    text = io.StringIO(newline="")
    csv.writer(text).writerows([header, *cells])
    write_file(sweep_dir / "sweep_summary.csv", text.getvalue().encode())
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(c.replace("|", "/") for c in row) + " |" for row in cells]
    if ceilings(rows):
        lines += ["", ceilings(rows)]
    lines += ["", decision(rows, _settings(swept), best), drift(rows)]
    lines += [note for note in (recipe_note(rows, best),) if note]
    if best is not None:
        lines += [f"Reproduce: `{reproduce_command(best)}`"]
    if machine_lines(rows):
        lines += ["", *machine_lines(rows)]
    write_file(sweep_dir / "sweep_summary.md", ("\n".join(lines) + "\n").encode())
    # one point per setting: a repeated setting's first job carries the figures of all its runs (sweep/rank.py)
    firsts = list({setting_of(row): row for row in reversed(rows)}.values())[::-1]
    plot(sweep_dir / "sweep_summary.png", firsts, _settings(swept), best)


def _settings(swept: list[str]) -> list[str]:
    """The swept keys that make a setting (the repeat index does not)."""
    return [key for key in swept if key != REPEAT_KEY] or swept


def _batch_size(row: dict[str, Any]) -> int | None:
    value = str(row["overrides"].get(BATCH_KEY, ""))
    return int(value) if value.isdigit() else None  # an edited overrides.yaml may hold anything


def recipe_note(rows: list[dict[str, Any]], best: dict | None) -> str:
    """When the jobs differ in data.batch_size, the recommendation changes the training recipe, not only the
    loader: say so, and what to scale (hparams_search=loader_and_batch, or a batch size swept by hand)."""
    sizes = sorted({size for size in map(_batch_size, rows) if size is not None})
    chosen = _batch_size(best) if best is not None else None
    if chosen is None or len(sizes) < 2:
        return ""
    others = ", ".join(str(size) for size in sizes if size != chosen)
    return (
        f"Note: the recommended setting trains with {BATCH_KEY}={chosen} (others: {others}). That changes the "
        f"training recipe, not only the loader: a recipe tuned at batch size B needs optim.lr x {chosen}/B (the "
        "linear scaling rule), BatchNorm sees other batch statistics, and images/s alone does not show whether "
        f"it converges as well: check val_acc before adopting it, or keep {BATCH_KEY} fixed "
        "(hparams_search=loader does)."
    )


def reproduce_command(row: dict[str, Any]) -> str:
    """A single-run command with the job's settings (a search's own config group left out)."""
    kept = (f"{k}={v}" for k, v in row["overrides"].items() if k not in ("hparams_search", REPEAT_KEY))
    return " ".join(["python train.py", *kept])


def ceilings(rows: list[dict[str, Any]]) -> str:
    """With mode=loader and mode=compute jobs in the sweep: which ceiling bounds training, in one line; each
    figure is the fastest job's median window, told apart from another only when their 95% intervals are apart."""
    fastest: dict[str, Rate] = {}
    for row in rows:
        if row["status"] == "ok" and row.get("rate_median"):
            interval = (row["interval_low"], row["interval_high"]) if row["interval_low"] is not None else None
            candidate = Rate(row["rate_median"], interval, len(row["windows_all_ranks"]))
            if row["mode"] not in fastest or candidate.median > fastest[row["mode"]].median:
                fastest[row["mode"]] = candidate
    if "loader" not in fastest or "compute" not in fastest:
        return ""
    loader, compute = fastest["loader"], fastest["compute"]
    bound = "input-bound: the input pipeline" if loader.median < compute.median else "compute-bound: the model"
    bound = "the two are indistinguishable" if indistinguishable(loader, compute) else f"{bound} is the limit"
    line = f"Ceilings: input pipeline {loader.text()}, compute {compute.text()} -> {bound}"
    if "train" in fastest:
        train, limit = fastest["train"], min(loader, compute, key=lambda rate: rate.median)
        if train.median >= limit.median or indistinguishable(train, limit):
            line += f"; training reached {train.median:.1f} images/s, indistinguishable from the lower ceiling"
        else:
            line += f"; training reached {train.median:.1f} images/s ({train.median / limit.median:.0%} of the lower)"
    return line


def print_summary(rows: list[dict[str, Any]], swept: list[str], best: dict | None, sweep_dir: Path) -> None:
    """The console end of a sweep: one line per job, then the fastest setting and how to reproduce it."""
    print(f"\nSweep report ({len(rows)} jobs) in {sweep_dir}")
    engine = engine_column(rows, swept)
    for row in rows:
        if row["status"] == "ok" and row["images_per_sec"] is None:
            figures = f"      n/a img/s  {row['reason'] or 'not measured'}"
        elif row["status"] == "ok":
            rate, wait = row["images_per_sec"], row["data_wait_frac"] or 0.0
            low, high = row.get("interval_low"), row.get("interval_high")
            median = f"median window {row['rate_median']:.1f} ({low:.1f}-{high:.1f})" if low is not None else ""
            figures = f"{rate:9.1f} img/s  {median:<34} data wait {wait:6.1%}  {_costs(row, engine)}".rstrip()
        else:
            figures = f"{'DAMAGED' if row['status'] == DAMAGED else 'FAILED'}: {row['reason']}"
        print(f"  job {row['job']:>3}  {describe(row, swept):<40} {figures}  {row.get('confidence', '')}")
    if ceilings(rows):
        print(ceilings(rows))
    for line in machine_lines(rows)[1:]:  # the warning only: the console is short
        print(line)
    print(decision(rows, _settings(swept), best))
    print(drift(rows))
    if recipe_note(rows, best):
        print(recipe_note(rows, best))
    if best is None:
        print()
        return
    if best.get("verdict"):
        print(f"  {best['verdict']}")
    print(f"Reproduce it: {reproduce_command(best)}\n", flush=True)


def build_report(sweep_dir: Path, min_gain: float = MIN_GAIN) -> dict[str, Any] | None:
    """Collect, rank, write and print; returns the recommended row (None when no job finished)."""
    rows, swept = collect(sweep_dir)
    if not rows:
        return None
    best = rank(rows, min_gain)
    try:
        write_reports(sweep_dir, rows, swept, best)
    except RunError as error:  # a name we may not write: the console summary still ends the sweep
        log.error("the sweep report's files are not written: %s", error)
    print_summary(rows, swept, best, sweep_dir)
    return best


class SweepReport(Callback):
    """Hydra callback: after the last job of a multirun, write and print the sweep report. `min_gain`: without
    repeats, the smallest speed-up (a ratio of medians minus 1) the report calls a difference (sweep/rank.py)."""

    def __init__(self, min_gain: float = MIN_GAIN) -> None:
        if not 0 <= min_gain < 1:
            raise RunEnded(
                EXIT_BAD_INPUT,
                f"error: hydra.callbacks.sweep_report.min_gain={min_gain}: expected a fraction in [0, 1), "
                f"for example {MIN_GAIN} (a {MIN_GAIN:.0%} speed-up)",
            )
        self.min_gain = min_gain

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        if global_rank() != 0:  # inside torchrun every rank runs the sweep; one report is enough
            return
        try:
            build_report(Path(config.hydra.sweep.dir), self.min_gain)
        except Exception as error:  # the jobs' own results are on disk whatever happens here
            log.error("could not build the sweep report: %s", error)
