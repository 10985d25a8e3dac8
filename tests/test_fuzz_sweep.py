"""Fuzz target for the files a sweep's jobs leave, read back by the report (sweep/jobs.py, sweep/files.py, and what
ranks and prints the rows: sweep/rank.py, sweep/report.py), seeded from fuzz_seeds/sweep/ (two real jobs' metrics.json
and .hydra/overrides.yaml, a failed.json and a stopped.json as run.py writes them; and overrides.yaml files of YAML
aliases, one list shared ten times at each of nine levels and one that holds itself). The property: whatever a
job's files hold (mutated byte by byte, field by field, or missing), the report's reading, ranking and printing end
without an exception, each sweep within the bound; the intact job stays a measured row, the other is a row (ok,
failed, stopped or damaged with its reason). The plot is drawn in the slow test only (matplotlib takes a second).
"""

from __future__ import annotations

import contextlib
import io
import json
import shutil
from pathlib import Path

import pytest
from fuzzing import bounded, fast, json_text, mutated, mutated_tree, seed_files, slow
from hypothesis import given, settings
from hypothesis import strategies as st

from imgtrain.sweep.files import MAX_JOB_FILE_BYTES
from imgtrain.sweep.jobs import DAMAGED, collect
from imgtrain.sweep.rank import MIN_GAIN, decision, drift, rank
from imgtrain.sweep.report import (
    _settings,
    build_report,
    ceilings,
    machine_lines,
    print_summary,
    recipe_note,
    table,
)

SEEDS = seed_files("sweep")
OVERRIDES = [data for name, data in SEEDS.items() if name.startswith("overrides")]
RECORDS = [SEEDS["failed.json"], SEEDS["stopped.json"]]
NAMES = {"metrics": "metrics.json", "overrides": ".hydra/overrides.yaml", "failed": "failed.json"}
NAMES["stopped"] = "stopped.json"


def _absent_or(strategy: st.SearchStrategy) -> st.SearchStrategy:
    return st.one_of(st.none(), strategy)


def _metrics_trees() -> st.SearchStrategy[bytes]:
    seeds = [SEEDS["metrics.json"], SEEDS["metrics_1.json"]]
    trees = st.sampled_from(seeds).flatmap(lambda seed: mutated_tree(json.loads(seed)))
    return st.one_of(mutated(seeds), trees.map(lambda tree: json_text(tree).encode()))


JOB_FILES = st.fixed_dictionaries(
    {
        "metrics": _absent_or(_metrics_trees()),
        "overrides": _absent_or(st.one_of(st.sampled_from(OVERRIDES), mutated(OVERRIDES))),
        "failed": _absent_or(mutated(RECORDS)),
        "stopped": _absent_or(st.sampled_from([SEEDS["stopped.json"]])),
    }
)


def _sweep(folder: Path, files: dict[str, bytes | None]) -> Path:
    """Job 0 as the real sweep left it; job 1 with `files` (None: absent)."""
    sweep = folder / "sweep"
    shutil.rmtree(sweep, ignore_errors=True)
    for num, job in ((0, {"metrics": SEEDS["metrics.json"], "overrides": SEEDS["overrides.yaml"]}), (1, files)):
        (sweep / str(num) / ".hydra").mkdir(parents=True)
        for key, data in job.items():
            if data is not None:
                (sweep / str(num) / NAMES[key]).write_bytes(data)
    return sweep


def report_target(folder: Path, files: dict[str, bytes | None], draw_plot: bool = False) -> None:
    sweep = _sweep(folder, files)
    with bounded("the sweep report", 30 if draw_plot else 2), contextlib.redirect_stdout(io.StringIO()):
        if draw_plot:
            build_report(sweep)
            assert (sweep / "sweep_summary.md").exists()
            return
        rows, swept = collect(sweep)
        best = rank(rows, MIN_GAIN)
        table(rows, swept)
        lines = [ceilings(rows), decision(rows, _settings(swept), best), drift(rows), recipe_note(rows, best)]
        lines += machine_lines(rows)
        print_summary(rows, swept, best, sweep)
    assert all(isinstance(line, str) for line in lines)
    assert rows[0]["status"] == "ok" and rows[0]["images_per_sec"] is not None
    assert rows[1]["status"] in ("ok", "failed", "stopped", DAMAGED) and "\n" not in str(rows[1]["reason"])


@fast()
@given(JOB_FILES)
def test_whatever_a_job_left_the_report_reads_ranks_and_prints(tmp_path: Path, files: dict) -> None:
    report_target(tmp_path, files)


@pytest.mark.parametrize("name", ["overrides_alias_bomb.yaml", "overrides_holds_itself.yaml"])
def test_overrides_of_yaml_aliases_are_a_damaged_row_at_once(tmp_path: Path, name: str) -> None:
    """repr() of the first entry, for the row's reason, walked a billion items (in C: no signal stops it)."""
    report_target(tmp_path, {"metrics": SEEDS["metrics_1.json"], "overrides": SEEDS[name]})
    rows, _ = collect(tmp_path / "sweep")
    assert rows[1]["status"] == DAMAGED and "an alias (*name), which no imgtrain file holds" in rows[1]["reason"]


def test_a_job_file_larger_than_a_run_writes_is_not_read(tmp_path: Path) -> None:
    sweep = _sweep(tmp_path, {"overrides": SEEDS["overrides_1.yaml"]})
    with open(sweep / "1" / "metrics.json", "wb") as file:
        file.truncate(MAX_JOB_FILE_BYTES + 1)  # sparse: takes no disk
    rows, _ = collect(sweep)
    assert rows[1]["status"] == DAMAGED and rows[1]["reason"] == (
        "metrics.json is larger than 16 MiB, more than a run writes: not read"
    )


@pytest.mark.slow  # a few minutes: the target on SLOW examples, and the whole report with its plot on 100
def test_the_sweep_target_on_a_larger_budget(tmp_path: Path) -> None:
    slow()(given(JOB_FILES)(lambda files: report_target(tmp_path, files)))()
    settings(slow(), max_examples=100, deadline=None)(
        given(JOB_FILES)(lambda files: report_target(tmp_path, files, draw_plot=True))
    )()


@pytest.mark.parametrize("peak", [-1, float("nan")])
def test_a_memory_peak_below_zero_or_not_a_number_is_a_damaged_row(tmp_path: Path, peak: float) -> None:
    """Found by the target above: a job whose pss_peak_gb was -1 left no setting under the memory ceiling of
    `cheapest`, and the report stopped on min() of nothing."""
    metrics = json.loads(SEEDS["metrics_1.json"]) | {"pss_peak_gb": peak}
    report_target(tmp_path, {"metrics": json.dumps(metrics).encode(), "overrides": SEEDS["overrides_1.yaml"]})
    rows, _ = collect(tmp_path / "sweep")
    assert rows[1]["status"] == DAMAGED and rows[1]["reason"] == (
        f"metrics.json: pss_peak_gb is {peak}, expected a number of GB, 0 or more or null"
    )


def test_a_failed_jobs_error_with_a_line_break_is_one_line_in_the_report(tmp_path: Path) -> None:
    """Found by the target above: a failed.json whose error holds a line break (edited, or another tool's) broke the
    report's table and summary lines."""
    failed = json.dumps({"error": "error: model.arch=x: not\nknown"}).encode()
    report_target(tmp_path, {"metrics": None, "overrides": None, "failed": failed, "stopped": None})
    rows, _ = collect(tmp_path / "sweep")
    assert rows[1]["status"] == "failed" and rows[1]["reason"] == "error: model.arch=x: not known"
