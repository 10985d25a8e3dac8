"""gpu-check's parts after the environment: the GPU tests, and the profile of the slowest JPEG row. Each takes the
check (gpu_check.Check: its deadline, its `run` with a time limit, its log and report) and returns its section."""

from __future__ import annotations

import json
import os
import shutil
import signal
import time
from pathlib import Path
from typing import Any

import gpu_rows  # benchmarks/gpu_rows.py
import gpu_tests  # benchmarks/gpu_tests.py

BENCHMARKS = Path(__file__).resolve().parent
MIN_START_S = 15  # a part is started only with this much left before the deadline: less measures nothing
DECODERS_LIMIT_S = 60  # the decoder part: decode-only rates of every decoder, before the rows
# The profiled run: the row's own arguments, with the steps to reach a steady state (compilation, the workers' start),
# one profiler warm-up step and PROFILE_STEPS recorded (metrics/profiling.py), then a few more
PROFILE_STEPS, PROFILE_LIMIT_S = 5, 120
TRACE_MAX_BYTES = 24 * 2**20  # a larger trace stays on the box: the top-operator table comes back regardless


def section_tests(check: Any, packages: dict) -> dict:
    """The GPU tests, cut by SIGINT at their limit: pytest then still writes pytest.xml with what finished. The
    stated selection is kept by the gpu_select plugin in pytest's own collection (no collect-only pass first)."""
    wanted = gpu_tests.selected(check.args.tests)
    result: dict = {"selection": "all (-m gpu)" if check.args.tests == "all" else "stated", "limit_s": 0}
    pytest_found = packages.get("pytest", {"loads": True})  # unknown when the env check failed: try
    why = "--tests none" if check.args.tests == "none" else None
    why = why or (None if pytest_found["loads"] else f"pytest does not load here ({pytest_found['why']})")
    why = why or (f"the deadline ({check.args.deadline_s:.0f} s)" if check.left() < MIN_START_S else None)
    if why:
        return result | {"status": f"not run: {why}", "not_reached": wanted}
    limit, started = min(check.args.tests_limit_s, check.left()), time.monotonic()
    xml, log = check.out / "pytest.xml", check.out / "pytest.log"
    listed, missing = check.workdir / "gpu-tests.json", check.workdir / "gpu-tests-missing.json"
    xml.unlink(missing_ok=True)
    missing.unlink(missing_ok=True)
    listed.write_text(json.dumps(wanted))
    files = sorted({node.split("::")[0] for node in wanted})
    argv = [*gpu_rows.python(), "-m", "pytest", "-m", "gpu", "-v", "-rs", "-p", "no:cacheprovider"]
    argv += [*(["-p", "gpu_select"] if wanted else []), f"--junitxml={xml}", *files]
    env = {"IMGTRAIN_GPU_TESTS": str(listed), "IMGTRAIN_GPU_TESTS_MISSING": str(missing)} if wanted else {}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(BENCHMARKS), check.env.get("PYTHONPATH")]))
    check.log(f"tests: {len(wanted) or 'every'} GPU test(s), limit {limit:.0f} s: {' '.join(argv[1:])}")
    status, cut = check.run(argv, limit, log, stop=signal.SIGINT, env=env)
    result |= {"limit_s": round(limit), "seconds": round(time.monotonic() - started, 1), "exit": status}
    result["not_found"] = json.loads(missing.read_text()) if missing.exists() else []
    found = [node for node in wanted if node not in result["not_found"]]
    result |= gpu_tests.summary(xml, log, found)
    result["status"] = cut or ("ran" if status in (0, 1, 5) else f"pytest ended with exit status {status}")
    failed = ", ".join(result["failed"]) or "none failed"
    check.log(f"tests: {result['status']}: {result['passed']} passed, {failed}, {result['skipped']} skipped")
    return result


def section_decoders(check: Any, folder: Path, data: dict) -> dict:
    """The decoder part (benchmarks/gpu_decoders.py) in a process of its own: each decoder's decode-only images/s
    on the mixed folder, and `chosen`, the dataset.gpu_decoder the JPEG row then uses."""
    if "error" in data:
        return {"status": f"not run: the photos dataset: {data['error']}"}
    if check.left() < MIN_START_S:
        return {"status": f"not run: the deadline ({check.args.deadline_s:.0f} s)"}
    limit, report = min(DECODERS_LIMIT_S, check.left()), check.workdir / "decoders.json"
    report.unlink(missing_ok=True)
    sizes = ["--batch-size", "8", "--batches", "2", "--rounds", "2"] if check.args.quick else []
    argv = [*gpu_rows.python(), str(BENCHMARKS / "gpu_decoders.py"), f"--folder={folder}", f"--json={report}"]
    argv += [*sizes, f"--limit-s={max(1.0, limit - 20)}"]  # its rounds stop in time for the process to end
    log = check.workdir / "decoders.log"
    log.write_text("")
    check.log(f"decoders: limit {limit:.0f} s")
    status, cut = check.run(argv, limit, log)
    if status == 0 and report.exists():
        result = {"status": "ran"} | json.loads(report.read_text())
    else:
        lines = log.read_text(errors="replace").strip().splitlines()
        result = {"status": f"failed: {cut or (lines[-1][:300] if lines else f'exit status {status}')}"}
    check.log(f"decoders: {result['status']}; chosen: {result.get('chosen')}")
    return result


def profile_args(row: gpu_rows.Row) -> list[str]:
    """The row's command, profiled: its warm-up, one profiler warm-up step, PROFILE_STEPS recorded, two more."""
    _, warmup, _ = row.steps
    steps = warmup + 1 + PROFILE_STEPS + 2
    timing = [f"train.max_steps={steps}", f"metrics.skip_first_steps={warmup}", "metrics.log_every_n_steps=2"]
    return [*row.args, *timing, "metrics.profile=true", f"metrics.profile_steps={PROFILE_STEPS}"]


def section_profile(check: Any, rows: list[gpu_rows.Row]) -> dict:
    """The slowest JPEG row (the lowest share of its ceiling) again, profiled, so that the next step is read from a
    trace: its top-operator table and, when small enough, its trace go into runs.tar.gz (runs/profile/)."""
    slowest = gpu_rows.slowest_jpeg_row(check.report["rows"])
    row = next((r for r in rows if slowest and r.key == slowest["key"]), None)
    if row is None:
        return {"status": "not run: no JPEG row was measured"}
    if check.left() < MIN_START_S + 30:
        return {"status": f"not run: the deadline ({check.args.deadline_s:.0f} s)", "row": row.key}
    run_dir = check.workdir / "runs" / "profile"
    shutil.rmtree(run_dir, ignore_errors=True)
    run_dir.mkdir(parents=True)
    args = [*profile_args(row), "checkpoint.save=false", "metrics.progress_bar=false"]
    limit, started = min(PROFILE_LIMIT_S, check.left()), time.monotonic()
    check.log(f"profile of {row.key}: limit {limit:.0f} s")
    argv = [*gpu_rows.python(), "train.py", *args, f"hydra.run.dir={run_dir}"]
    status, cut = check.run(argv, limit, run_dir / "output.log")
    traces = sorted((run_dir / "profile").glob("trace_rank*.json.gz")) if (run_dir / "profile").exists() else []
    for trace in traces:
        if trace.stat().st_size > TRACE_MAX_BYTES:
            trace.rename(trace.with_suffix(".gz.too-large"))
    tables = sorted((run_dir / "profile").glob("top_ops_rank*.txt")) if (run_dir / "profile").exists() else []
    result = {"row": row.key, "command": "python train.py " + " ".join(args), "exit": status}
    result |= {"seconds": round(time.monotonic() - started, 1), "top_ops": tables[0].read_text() if tables else None}
    result["status"] = cut or ("ran" if status == 0 and tables else f"no trace (exit status {status})")
    check.log(f"profile of {row.key}: {result['status']}")
    return result
