"""What each job of a sweep left in its directory, as one row of the report: `.hydra/overrides.yaml` (its setting),
`metrics.json` (its figures), `failed.json` or `stopped.json` (why it ended early). It works the same with the basic
launcher and with submitit, and a job whose files are missing or damaged becomes a marked row, not a lost sweep.
"""

from __future__ import annotations

import math
import statistics
from pathlib import Path
from typing import Any

from imgtrain.common.brief import brief, single_line
from imgtrain.sweep.files import Damaged, read_json, read_yaml
from imgtrain.sweep.plot import STAGES
from imgtrain.sweep.rank import spread_of

THROUGHPUT_COLUMNS = ("images_per_sec", "images_per_sec_median", "images_per_sec_p25", "images_per_sec_p75")
METRIC_COLUMNS = (
    *THROUGHPUT_COLUMNS,
    "data_wait_frac",
    "gpu_util_mean",
    "cpu_pct_mean",
    "rss_peak_gb",
    "val_acc",
)
# What a setting costs, shown beside its throughput (report.table): the loader engine (`loader.engine`; only where
# the swept columns do not already say it), the memory peak (PSS, GB) and the epoch-start stall (metrics/
# epoch_start.py: the median later epoch start's cost as a share of an epoch, and in seconds).
COST_COLUMNS = ("engine", "pss_peak_gb", "epoch_start_cost_frac", "epoch_start_cost_s")
# From `loader`, `pss_peak_gb`, the epoch start, `pipeline` and `tune` in metrics.json (newer runs only): a column
# empty in every row is left out.
OPTIONAL_COLUMNS = (
    *COST_COLUMNS,
    "input_stage",
    "worker_busy_frac",
    *(f"{stage}_ms" for stage in STAGES),  # ms per image (worker stages: CPU time summed over workers)
    "tune_chosen",
)
OVERRIDES = ".hydra/overrides.yaml"  # as Hydra writes it: a list of key=value strings
STOPPED = "stopped.json"  # a job a stop signal ended (its checkpoint saved): it ends the sweep too
DAMAGED = "damaged"  # the status of a job whose files the report cannot use

# What the report computes with, by the type metrics.json gives it (a run writes these; an edit may not). The
# display-only fields (pipeline's and tune's contents, the environment) are shown as they are, never computed with.
QUARTILES = ("images_per_sec_p25", "images_per_sec_p75")  # computed here from the windows, not read
NUMBERS = (
    *(key for key in METRIC_COLUMNS if key not in QUARTILES),
    "images_per_sec_per_process",
    "epoch_start_cost_frac",
)
SIZES = ("pss_peak_gb",)  # finite and not negative: `cheapest` compares the peaks as amounts of memory
LISTS = ("images_per_sec_windows", "epoch_start_cost_s")  # lists of numbers
TEXTS = ("mode", "verdict", "images_per_sec_note", "images_per_sec_interval_note")
RECORDS = ("loader", "pipeline", "tune", "environment")
LOADER_NUMBERS = ("num_workers", "prefetch_factor")
LOADER_FLAGS = ("pin_memory", "persistent_workers")
LOADER_TEXTS = ("engine",)


def _is_number(value: Any) -> bool:
    """A JSON number the report can compute with: not a bool, and an int only if a float can hold it."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return False
    try:
        float(value)
    except OverflowError:  # an integer of hundreds of digits: JSON allows it, no arithmetic on floats does
        return False
    return True


def _size(value: Any) -> bool:
    return _is_number(value) and math.isfinite(value) and value >= 0


def _finite_numbers(value: Any) -> bool:
    return isinstance(value, list) and all(_is_number(v) and math.isfinite(v) for v in value)


def _shown(value: Any) -> str:
    return brief(value, 40)


def wrong_field(metrics: dict[str, Any]) -> str | None:
    """The first field of `metrics` the report cannot compute with, and what it expects; None when all fit."""
    expected = [(key, _is_number, "a number") for key in NUMBERS]
    expected += [(key, _size, "a number of GB, 0 or more") for key in SIZES]
    expected += [(key, lambda v: isinstance(v, str), "a string") for key in TEXTS]
    expected += [(key, lambda v: isinstance(v, dict), "an object") for key in RECORDS]
    expected += [(key, _finite_numbers, "a list of numbers") for key in LISTS]
    for key, fits, kind in expected:
        if metrics.get(key) is not None and not fits(metrics[key]):
            return f"{key} is {_shown(metrics[key])}, expected {kind} or null"
    loader = metrics.get("loader") or {}
    for key, fits, kind in [
        *((key, _is_number, "a number") for key in LOADER_NUMBERS),
        *((key, lambda v: isinstance(v, bool), "true or false") for key in LOADER_FLAGS),
        *((key, lambda v: isinstance(v, str), "a string") for key in LOADER_TEXTS),
    ]:
        if loader.get(key) is not None and not fits(loader[key]):
            return f"loader.{key} is {_shown(loader[key])}, expected {kind} or null"
    return None


def overrides(job_dir: Path) -> dict[str, str]:
    """The job's overrides as {key: value} (Hydra's own left out); Damaged when the file is not a list of
    key=value strings, as Hydra writes it."""
    path = job_dir / OVERRIDES
    if not path.exists():
        return {}
    entries = read_yaml(path, OVERRIDES)
    if entries is None:
        return {}
    strays = [entry for entry in entries if not isinstance(entry, str)] if isinstance(entries, list) else [entries]
    if strays:
        raise Damaged(f"{OVERRIDES}: expected a list of key=value overrides, found {_shown(strays[0])}")
    return dict(entry.split("=", 1) for entry in entries if "=" in entry and not entry.startswith("hydra"))


def _quartiles(values: list[float]) -> tuple[float | None, float | None]:
    if len(values) < 2:
        return (values[0], values[0]) if values else (None, None)
    q = statistics.quantiles(values, n=4, method="inclusive")
    return q[0], q[2]


def _dict(value: Any) -> dict[str, Any]:
    return value if isinstance(value, dict) else {}


def _optional(metrics: dict[str, Any]) -> dict[str, Any]:
    """The optional columns' values (None when missing) and the dicts the plot and the environment lines read."""
    pipeline, tune = _dict(metrics.get("pipeline")), _dict(metrics.get("tune"))
    stages = _dict(pipeline.get("stage_ms_per_image"))
    costs = metrics.get("epoch_start_cost_s") or []  # seconds, one per epoch start after the first
    values = {
        "pss_peak_gb": metrics.get("pss_peak_gb"),
        "input_stage": pipeline.get("input_stage"),
        "worker_busy_frac": pipeline.get("worker_busy_frac"),
        "tune_chosen": tune.get("chosen"),
        "epoch_start_cost_frac": metrics.get("epoch_start_cost_frac"),
        "epoch_start_cost_s": statistics.median(costs) if costs else None,  # as the share is: the median start
        **{f"{stage}_ms": stages.get(stage) for stage in STAGES},
    }
    return {**values, "pipeline": pipeline, "tune": tune, "environment": _dict(metrics.get("environment"))}


def _object(path: Path) -> dict[str, Any]:
    """The JSON object in `path`; Damaged when it is not one."""
    value = read_json(path)
    if not isinstance(value, dict):
        raise Damaged(f"{path.name} does not hold a JSON object")
    return value


def _metrics(job_dir: Path) -> dict[str, Any] | None:
    """The job's metrics.json (None when it has none); Damaged when the report cannot compute with it."""
    path = job_dir / "metrics.json"
    if not path.exists():
        return None
    metrics = _object(path)
    problem = wrong_field(metrics)
    if problem:
        raise Damaged(f"metrics.json: {problem}")
    return metrics


def _finished(row: dict[str, Any], metrics: dict[str, Any]) -> None:
    row["status"], row["reason"] = "ok", metrics.get("images_per_sec_note") or ""  # why a figure is missing
    row.update({key: metrics.get(key) for key in METRIC_COLUMNS})
    row["images_per_sec_p25"], row["images_per_sec_p75"] = _quartiles(metrics.get("images_per_sec_windows") or [])
    row.update(spread_of(metrics))
    row["verdict"] = metrics.get("verdict") or ""
    row["mode"] = metrics.get("mode") or "train"
    row.update(_optional(metrics))


def _unfinished(row: dict[str, Any], job_dir: Path, status: str, reason: str) -> dict[str, Any]:
    """A row without figures: a damaged job's, or one that failed or was stopped (its record says why)."""
    if status != DAMAGED:
        for path, meaning in ((job_dir / "failed.json", "failed"), (job_dir / STOPPED, "stopped")):
            if path.exists():
                try:
                    error = _object(path).get("error")
                    reason = reason if error is None else single_line(str(error))  # a file's, maybe edited
                except Damaged as damage:
                    reason = str(damage)
                status = meaning
    row["status"], row["reason"], row["verdict"], row["mode"] = status, reason, "", ""
    row.update({key: None for key in METRIC_COLUMNS})
    row.update(_optional({}))
    row.update(spread_of({}))
    return row


def read_job(job_dir: Path) -> dict[str, Any]:
    """One row: the job's overrides, its status, and its figures (empty when it failed, or when a file the report
    needs is damaged: status "damaged", and the reason names the file and what is wrong with it)."""
    row: dict[str, Any] = {"job": job_dir.name, "overrides": {}}
    try:
        row["overrides"] = overrides(job_dir)
        metrics = _metrics(job_dir)
    except Damaged as damage:
        return _unfinished(row, job_dir, DAMAGED, str(damage))
    except OSError as error:  # the job's folder itself unreadable (its permissions)
        return _unfinished(row, job_dir, DAMAGED, f"its folder cannot be read ({error.strerror or error})")
    if metrics is None:
        return _unfinished(row, job_dir, "failed", "no metrics.json: the job was killed or crashed before it finished")
    _finished(row, metrics)
    return row


def collect(sweep_dir: Path) -> tuple[list[dict[str, Any]], list[str]]:
    """Every job's row (in job order) and the keys whose values differ between jobs (the swept keys)."""
    jobs = sorted((p for p in sweep_dir.iterdir() if p.is_dir() and p.name.isdigit()), key=lambda p: int(p.name))
    rows = [read_job(job) for job in jobs]
    known = [row for row in rows if row["overrides"] or row["status"] != DAMAGED]  # not a lost overrides.yaml
    keys: list[str] = []
    for row in known:
        keys += [k for k in row["overrides"] if k not in keys]
    swept = [k for k in keys if len({row["overrides"].get(k) for row in known}) > 1] or keys
    return rows, swept
