"""The fuzz targets under Atheris (tests/atheris_targets.py), coverage-guided, each for SECONDS from its seeds: make
test-slow only. A crash (a failed property, an exception a reader does not document, a hang past the bound on one
input) fails the test with libFuzzer's report and the input it saved; that input becomes a seed in
fuzz_seeds/<target>/ when it is fixed."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("atheris", reason="Atheris: pip install -e '.[dev]' (CPython 3.11+ on x86-64 Linux)")
pytest.importorskip("optuna", reason="the search-space target needs the search extra")

HARNESS = Path(__file__).resolve().parent / "atheris_targets.py"
TARGETS = ["csv", "manifest", "partial", "index", "checkpoint", "space", "job_metrics", "job_overrides"]
SECONDS = 5  # each target's run: tens of thousands of inputs for the quick parsers, thousands for the rest
# CI (CI=1) starts every run from the same seed, as its Hypothesis runs are derandomized (conftest.py): the inputs
# are the same sequence each time, as far as the machine's speed takes it; elsewhere libFuzzer draws a seed
SEED = ["-seed=1"] if os.environ.get("CI") else []


@pytest.mark.slow  # about 3 minutes in all
@pytest.mark.parametrize("target", TARGETS)
def test_atheris_finds_no_crash(target: str, tmp_path: Path) -> None:
    corpus, found = tmp_path / "corpus", tmp_path / "found"
    corpus.mkdir()
    found.mkdir()
    (tmp_path / "work").mkdir()
    env = {**os.environ, "PYTHONHASHSEED": "0", "IMGTRAIN_FUZZ_DIR": str(tmp_path / "work")}
    subprocess.run([sys.executable, str(HARNESS), target, "--write-corpus", str(corpus)], check=True, env=env)
    flags = [*SEED, f"-max_total_time={SECONDS}", "-timeout=0", "-rss_limit_mb=4096", f"-artifact_prefix={found}/"]
    result = subprocess.run(
        [sys.executable, str(HARNESS), target, *flags, str(corpus)],
        capture_output=True,
        text=True,
        timeout=SECONDS + 180,  # start-up, and a last input that hangs in C code (no signal stops it)
        env=env,
    )
    crashes = sorted(found.iterdir())
    assert result.returncode == 0 and not crashes, f"{crashes}\n{result.stderr[-6000:]}"
    assert "Done " in result.stderr, result.stderr[-3000:]
