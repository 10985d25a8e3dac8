"""`make gpu-check` cannot rot unseen: it runs here in the GPU box's emulation (tests/gpubox.py: no Hydra until
the device wheels of ../shared/device-wheels are installed with pip, one call per wheel; where that folder is
missing, as in a CI checkout without it, this venv's Hydra, OmegaConf, antlr4 and submitit files are linked in
instead; no TorchCodec where its wheel, built for CPython 3.12, does not install), with the rows scaled down
(--quick: tiny datasets, a few steps, on the CPU where there is no CUDA). A deadline that has passed leaves the
environment check and a table that says why the rest was not measured (make test); the whole quick check runs
every part (make test-slow). The stated GPU test selection names tests that exist, covering every CUDA path.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import tarfile
import time
from pathlib import Path
from types import SimpleNamespace

import gpubox
import numpy as np
import pytest
from helpers import ROOT
from test_gpubox import make

sys.path.insert(0, str(ROOT / "benchmarks"))
import gpu_check  # noqa: E402
import gpu_rows  # noqa: E402
import gpu_table  # noqa: E402
import gpu_tests  # noqa: E402
import photos  # noqa: E402

ROW_KEYS = [row.key for row in gpu_rows.check_rows(gpu_rows.QUICK, "/unused", 1)]
ROW_FIELDS = ("key", "what", "command", "max_steps", "skip_first_steps", "log_every_n_steps", "target", "met")
OUT_NAME = r"^[A-Za-z0-9._-]+$"  # what a remote call to the GPU box brings back: at most 8 files, these letters


def _check(box: gpubox.Box, out: Path, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    """`make gpu-check NOVENV=1` in the emulated box, as docs/gpu.md tells the GPU box to call it."""
    argv = ["gpu-check", f"GPU_CHECK_OUT={out}", "GPU_CHECK_COMMIT=abc1234", f"ARGS={' '.join(args)}"]
    return make(box, *argv, timeout=timeout)


def _report(out: Path) -> dict:
    report = json.loads((out / "gpu-check.json").read_text())
    table = (out / "gpu-check.md").read_text()
    assert f"commit {report['commit']}" in table and report["commit"] == "abc1234"
    rows = [line for line in table.splitlines() if line.startswith("| r")]
    assert [line.split(" | ")[0][2:] for line in rows] == [row["key"] for row in report["rows"]] == ROW_KEYS
    for row in report["rows"]:
        assert all(key in row for key in ROW_FIELDS), row
        assert row.get("images_per_sec") or row["not_measured"].startswith("not measured: "), row
    files = sorted(p.name for p in out.iterdir() if not p.name.startswith("."))
    assert len(files) <= 8 and all(re.match(OUT_NAME, name) for name in files), files
    return report


@pytest.mark.slow  # slow: the fast suite's budget (make test <= 120 s on 2 cores); CI runs it in make test-slow
def test_a_passed_deadline_leaves_the_environment_check_and_says_why_for_the_rest(
    gpu_box: gpubox.Box, tmp_path: Path
) -> None:
    """Results are written as they come: with the deadline gone when the check starts, the environment check
    still runs (a few seconds) and is in the JSON and the table; every later part says the deadline stopped it."""
    out = tmp_path / "out"
    result = _check(gpu_box, out, "--quick", "--deadline-s 0", f"--workdir {tmp_path / 'work'}")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    report = _report(out)
    env = report["sections"]["env"]
    assert env["status"] == "ran" and report["machine"]["python"] and report["machine"]["no_site"] is True
    packages = env["packages"]
    assert packages["hydra-core"]["loads"] and packages["hydra-core"]["from"].startswith(str(gpu_box.wheels))
    assert packages["litdata"]["loads"] is False and packages["optuna"]["loads"] is False
    assert packages["torchcodec"]["loads"] is gpubox.torchcodec_installed(gpu_box) or packages["torchcodec"]["loads"]
    assert report["sections"]["tests"]["status"] == "not run: the deadline (0 s)"
    assert report["sections"]["data"]["status"] == "not started: the deadline (0 s)"
    assert all(row["not_measured"] == "not measured: the deadline (0 s) came first" for row in report["rows"])
    assert report["finished"] is True
    assert "GPU tests (stated): not run: the deadline (0 s)" in (out / "gpu-check.md").read_text()


@pytest.mark.slow  # every part of the check, scaled down: 2-5 minutes on 2 busy cores
def test_the_quick_check_runs_every_part_in_the_gpu_box(gpu_box: gpubox.Box, tmp_path: Path) -> None:
    out = tmp_path / "out"
    args = ["--quick", "--deadline-s 600", "--tests-limit-s 120", f"--workdir {tmp_path / 'work'}"]
    result = _check(gpu_box, out, *args, timeout=900)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    report = _report(out)
    assert report["sections"]["env"]["status"] == "ran" and report["finished"] is True
    tests = report["sections"]["tests"]
    wanted = gpu_tests.selected("stated")
    assert tests["status"] == "ran" and tests["read_from"] == "junit" and tests["not_reached"] == []
    assert tests["passed"] + tests["skipped"] == len(wanted) and not tests["failed"]  # here: skipped, no CUDA
    data = report["sections"]["data"]["result"]
    folder = data["photos"]
    assert folder["train_files"] == photos.QUICK_COUNTS[0] and 0 < folder["big_share"] < 0.5
    assert "JPEGs" in (out / "gpu-check.md").read_text()
    rows = {row["key"]: row for row in report["rows"]}
    for key in ("r50_ceiling_compiled", "r18_ceiling", "r18_ceiling_graphs", "r50_ceiling_graphs"):  # synthetic data
        row = rows[key]
        assert row["images_per_sec"] > 0 and row["measured_steps"] > 0 and row["images_per_sec_interval"], row
    if not gpubox.torchcodec_installed(gpu_box):  # no CPU decoder here (torchvision >= 0.29 needs TorchCodec)
        assert "needs TorchCodec" in rows["r18_dataloader"]["not_measured"]
    assert "cuda" in rows["r50_jpeg_cuda"].get("not_measured", "cuda").lower()  # decode=cuda without a GPU
    share = rows["r18_dataloader"]["shares"][0]
    assert share["of"] == "r18_ceiling" and (
        share["value"] or "needs TorchCodec" in rows["r18_dataloader"]["not_measured"]
    )
    decoders = report["sections"]["decoders"]  # the host's decoders here: no GPU decoder, none chosen
    assert decoders["status"] == "ran" and decoders["chosen"] is None and decoders["rounds"] >= 1, decoders
    cpu_path = next(row for row in decoders["decoders"] if row["decoder"] == "cpu path")
    assert cpu_path.get("images_per_s", 0) > 0 or "needs TorchCodec" in cpu_path["not_measured"], decoders
    assert "| host whole |" in (out / "gpu-check.md").read_text()  # nvImageCodec's CPU backend, from its wheel
    profile = report["sections"]["profile"]  # the slowest JPEG row profiled, where one was measured
    assert profile["status"] == "ran" or profile["status"] == "not run: no JPEG row was measured", profile
    with tarfile.open(out / "runs.tar.gz") as tar:
        assert "runs/r18_ceiling/metrics.json" in tar.getnames()


@pytest.mark.slow  # slow: the fast suite's budget (make test <= 120 s on 2 cores); CI runs it in make test-slow
def test_every_stated_gpu_test_exists_and_every_cuda_path_has_one() -> None:
    """The selection gpu-check runs by default names tests pytest collects (a renamed test fails here, not on the
    GPU box), and covers the CUDA paths the issue lists."""
    files = sorted({node.split("::")[0] for node in gpu_tests.selected("stated")})
    cmd = [sys.executable, "-m", "pytest", "--collect-only", "-q", "-m", "gpu", "-p", "no:cacheprovider", *files]
    result = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120)
    collected = {line.strip() for line in result.stdout.splitlines() if "::" in line}
    assert collected, result.stdout[-2000:] + result.stderr[-2000:]
    assert [node for node in gpu_tests.selected("stated") if node not in collected] == []
    paths = {"prefetcher", "device crop and erasing", "decode=cuda", "mixup/EMA", "device-resident data"}
    assert paths <= set(gpu_tests.GPU_TESTS)
    result = subprocess.run(
        [*cmd[: -len(files)], "tests/test_gpu.py"], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert set(gpu_tests.COMPILING) <= {line.strip() for line in result.stdout.splitlines()}  # with --tests all


@pytest.mark.slow  # slow: the fast suite's budget (make test <= 120 s on 2 cores); CI runs it in make test-slow
def test_tests_cut_at_their_limit_still_report_what_finished(tmp_path: Path) -> None:
    """SIGINT at the limit: pytest writes its JUnit XML with the tests that finished; the one it cut and those it
    never reached are named as not reached."""
    (tmp_path / "test_sample.py").write_text(
        "import time\n\ndef test_quick():\n    pass\n\ndef test_slow():\n    time.sleep(60)\n\ndef test_after():\n"
        "    pass\n"
    )
    args = SimpleNamespace(out=tmp_path / "out", workdir=tmp_path / "work", quick=True, deadline_s=60, commit="x")
    check = gpu_check.Check(args)
    xml, log = tmp_path / "out" / "pytest.xml", tmp_path / "out" / "pytest.log"
    argv = [sys.executable, "-m", "pytest", "-v", "-p", "no:cacheprovider", f"--junitxml={xml}", "--rootdir", tmp_path]
    started = time.monotonic()
    status, cut = check.run([*map(str, argv), str(tmp_path / "test_sample.py")], 6, log, stop=signal.SIGINT)
    assert cut == "cut at 6 s by its limit" and time.monotonic() - started < 20
    wanted = [f"test_sample.py::{name}" for name in ("test_quick", "test_slow", "test_after")]
    found = gpu_tests.summary(xml, log, wanted)
    assert found["read_from"] == "junit" and found["passed"] == 1, found
    assert "test_sample.py::test_after" in found["not_reached"]


def test_a_row_meets_its_target_only_with_every_figure_it_needs() -> None:
    target = gpu_rows.Target("t", (("ceiling", 0.9),), util=95)
    done = [{"key": "ceiling", "images_per_sec": 1000.0}]
    assert gpu_table.judge(target, {"images_per_sec": 950.0, "gpu_util_mean": 96}, done)["met"] is True
    assert gpu_table.judge(target, {"images_per_sec": 950.0, "gpu_util_mean": 90}, done)["met"] is False
    assert gpu_table.judge(target, {"images_per_sec": 850.0, "gpu_util_mean": None}, done)["met"] is False
    assert gpu_table.judge(target, {"images_per_sec": 950.0, "gpu_util_mean": None}, done)["met"] is None
    unknown = gpu_table.judge(target, {"images_per_sec": 950.0, "gpu_util_mean": 99}, [])
    assert unknown["met"] is None and unknown["shares"] == [{"of": "ceiling", "value": None, "least": 0.9}]
    assert gpu_table.judge(gpu_rows.Target("rate", rate=50_000), {"images_per_sec": 49_999.0}, [])["met"] is False


def test_a_utilisation_target_can_be_relative_to_another_rows() -> None:
    """2026-11-27's H200: the eager ResNet-18 ceiling kept the GPU 76% busy, so the device-resident row at 102% of
    its rate and 72% busy meets a target of "within 5 points of the ceiling's", and the DataLoader row (43%) not."""
    target = gpu_rows.Target("t", (("ceiling", 0.9),), util_of=("ceiling", 5.0))
    done = [{"key": "ceiling", "images_per_sec": 46_019.0, "gpu_util_mean": 76.0}]
    assert gpu_table.judge(target, {"images_per_sec": 46_916.0, "gpu_util_mean": 72.0}, done)["met"] is True
    assert gpu_table.judge(target, {"images_per_sec": 46_916.0, "gpu_util_mean": 43.0}, done)["met"] is False
    no_util = [{"key": "ceiling", "images_per_sec": 46_019.0}]
    assert gpu_table.judge(target, {"images_per_sec": 46_916.0, "gpu_util_mean": 72.0}, no_util)["met"] is None


def test_the_table_gives_the_overall_rate_and_the_median_window_with_its_own_interval() -> None:
    """The overall rate can lie below the median window's interval (2026-11-27's r50_jpeg_cuda: 2,465 overall, the
    median window's interval 2,580-2,877): the interval is shown beside the median it belongs to."""
    entry = {"images_per_sec": 2465.0, "images_per_sec_median": 2720.0, "images_per_sec_interval": [2580.0, 2877.0]}
    assert gpu_table._rate(entry) == "2,465 / 2,720 (2,580-2,877)"
    assert gpu_table._rate({"images_per_sec": 10.0}) == "10 / — (no interval)"


def test_the_mixed_folder_has_imagenets_sizes_and_a_few_12_mp_photos(tmp_path: Path) -> None:
    """The distribution drawn (20,000 draws) and a quick folder generated: what the module's docstring says."""
    rng = np.random.default_rng(0)
    sizes = [photos.draw_size(rng) for _ in range(20_000)]
    big = [s for s in sizes if s[0] * s[1] == 12_000_000]
    rest = [s for s in sizes if s[0] * s[1] < 12_000_000]
    assert 0.025 < len(big) / len(sizes) < 0.035
    width, height = (sum(s[i] for s in rest) / len(rest) for i in (0, 1))
    assert 380 < width < 460 and 330 < height < 410, (width, height)  # about 420x370
    assert 0.45 < sum(1 for s in rest if max(s) == 500) / len(rest) < 0.8  # mostly 500 px on the long side
    folder = photos.ensure_folder(tmp_path, (40, 10), scale=0.25)
    described = photos.describe(folder)
    assert described["train_files"] == 40 and described["val_files"] == 10 and described["mean_kb"] > 1
    assert photos.ensure_folder(tmp_path, (40, 10), scale=0.25) == folder  # generated once


def test_the_stated_selection_is_kept_in_pytests_own_collection(tmp_path: Path) -> None:
    """benchmarks/gpu_select.py: the listed tests run, the others are deselected, a listed test that no longer
    exists is named, and the rest still run (node ids on the command line would have stopped the whole run)."""
    (tmp_path / "test_sample.py").write_text("def test_a():\n    pass\n\ndef test_b():\n    pass\n")
    listed, missing = tmp_path / "listed.json", tmp_path / "missing.json"
    listed.write_text(json.dumps(["test_sample.py::test_a", "test_sample.py::test_renamed"]))
    env = {**os.environ, "IMGTRAIN_GPU_TESTS": str(listed), "IMGTRAIN_GPU_TESTS_MISSING": str(missing)}
    env["PYTHONPATH"] = str(ROOT / "benchmarks")
    argv = [sys.executable, "-m", "pytest", "-v", "-p", "no:cacheprovider", "-p", "gpu_select", "test_sample.py"]
    result = subprocess.run(argv, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60)
    assert "test_sample.py::test_a PASSED" in result.stdout and "1 deselected" in result.stdout, result.stdout
    assert json.loads(missing.read_text()) == ["test_sample.py::test_renamed"]


def test_the_rows_table_in_docs_gpu_md_is_the_rows_gpu_check_runs_in_their_order() -> None:
    text = (ROOT / "docs" / "gpu.md").read_text()
    table = text.split("| key | what | steps (left out, window) | target |", 1)[1].split("\n\n", 1)[0]
    keys = re.findall(r"^\| `(\w+)` \|", table, re.M)
    rows = gpu_rows.check_rows(gpu_rows.FULL, "/unused", "auto")
    assert keys == [row.key for row in rows]
    for row, line in zip(rows, table.strip().splitlines()[1:], strict=True):
        steps, warmup, window = row.steps
        assert f"| {steps} ({warmup}, {window}) |" in line, line
