"""dataset=shards through real processes where the process is the point: exact resume after a real SIGTERM, a
resume with another worker count or world size, DDP (each rank a disjoint share, each sample once per epoch), a
conversion stopped by SIGTERM or Ctrl-C (its staging folder and workers gone) or killed with SIGKILL, and a worker
sweep with num_workers=tune."""

from __future__ import annotations

import collections
import csv
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import torch
from helpers import ROOT, compose_cfg, interrupt, read_metrics, run_train
from shardhelpers import shards_args, slowed_conversion, staging_folder, stop_after_step_5

pytest.importorskip("litdata", reason="dataset=shards needs the shards extra: pip install -e '.[shards]'")

from imgtrain.data.shards.manifest import MANIFEST, PARTIAL  # noqa: E402
from imgtrain.train.run import run  # noqa: E402

RESUMABLE = ["train.epochs=2", "system.deterministic=true", "checkpoint.every_n_steps=3"]


def _weights(run_dir: Path) -> dict:
    return torch.load(run_dir / "checkpoints" / "last.pt", map_location="cpu", weights_only=True)


def _same_weights(a: Path, b: Path) -> None:
    first, second = _weights(a), _weights(b)
    assert first["progress"]["step"] == second["progress"]["step"]
    for key, tensor in first["model"].items():
        assert torch.equal(tensor, second["model"][key]), key


@pytest.mark.slow  # two runs and a real process: about 25 s
def test_sigterm_mid_epoch_then_the_same_command_matches_an_uninterrupted_run(
    shards: Path, tmp_path: Path, data_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    args = shards_args(shards, *RESUMABLE)
    run(compose_cfg(*args, output_dir=str(tmp_path / "straight")))
    run_dir = tmp_path / "interrupted"
    stderr = interrupt(args, run_dir, data_dir)  # a real train.py and its worker, a real SIGTERM to the group
    assert "stopped: SIGTERM at step" in stderr and "Traceback" not in stderr
    stopped = _weights(run_dir)["progress"]
    assert 3 <= stopped["step"] < 16 and stopped["samples_in_epoch"] % 32 == 0
    run(compose_cfg(*args, output_dir=str(run_dir)))  # the same command in the same run directory
    _same_weights(tmp_path / "straight", run_dir)
    assert read_metrics(tmp_path / "straight")["val_loss"] == read_metrics(run_dir)["val_loss"]


@pytest.mark.slow  # three runs with two workers: about 20 s
def test_a_resume_with_fewer_workers_finishes_the_epoch_in_its_own_order(
    shards: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """LitData's order depends on the worker count: the interrupted epoch ends with the count it started with,
    so it ends bit-identical to an uninterrupted run with that count (one epoch: the whole run)."""
    one_epoch = shards_args(shards, "system.deterministic=true", "checkpoint.every_n_steps=3")
    run(compose_cfg(*one_epoch, "data.num_workers=2", output_dir=str(tmp_path / "straight")))
    saved = stop_after_step_5(monkeypatch, [*one_epoch, "data.num_workers=2"], tmp_path / "part")
    assert saved["data_order"] == {"epoch": 0, "world_size": 1, "num_workers": 2, "batch_size": 32}
    run(compose_cfg(*one_epoch, "data.num_workers=1", output_dir=str(tmp_path / "part")))
    assert "this epoch started with data.num_workers=2: it finishes with 2" in caplog.text
    _same_weights(tmp_path / "straight", tmp_path / "part")


@pytest.mark.slow  # a torchrun job, then a resume on one process (make test stays under 150 s)
def test_a_resume_on_fewer_ranks_says_in_one_line_what_litdata_does(
    shards: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A checkpoint whose epoch two ranks started, resumed by one process: LitData re-deals the rest of the epoch."""
    args = shards_args(shards, "train.epochs=2", "checkpoint.every_n_steps=3")
    stop_after_step_5(monkeypatch, args, tmp_path / "run")
    last = tmp_path / "run" / "checkpoints" / "last.pt"
    payload = torch.load(last, map_location="cpu", weights_only=True)
    payload["data_order"]["world_size"] = 2  # as two ranks of 32 would have saved it: 160 samples in, 5 x 32 ...
    payload["progress"]["samples_in_epoch"] = 192  # ... is not a multiple of 64: 3 x 64 = 192 is
    torch.save(payload, last)
    (tmp_path / "run" / "checkpoints" / "last.prev.pt").unlink(missing_ok=True)
    run(compose_cfg(*args, output_dir=str(tmp_path / "run")))
    notes = [r.getMessage() for r in caplog.records if "this epoch started with 2 rank(s)" in r.getMessage()]
    assert len(notes) == 1 and "LitData re-deals the rest of it onto the new ranks" in notes[0]
    assert "\n" not in notes[0] and read_metrics(tmp_path / "run")["steps"] >= 14


@pytest.mark.slow  # torchrun with 2 processes and their workers: about 40 s
def test_under_ddp_each_rank_reads_a_disjoint_share_and_each_sample_once(shards: Path, tmp_path: Path) -> None:
    spy = tmp_path / "spy"
    spy.mkdir()
    env = {**os.environ, "SPY_DIR": str(spy), "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    args = shards_args(shards, "data.num_workers=1", f"hydra.run.dir={tmp_path / 'run'}")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    result = subprocess.run(
        [*cmd, str(ROOT / "tests" / "spy_train.py"), *args], cwd=tmp_path, env=env, capture_output=True, text=True
    )
    assert result.returncode == 0, (result.stdout + result.stderr)[-3000:]
    reads = collections.defaultdict(list)
    for path in spy.iterdir():
        for line in path.read_text().splitlines():
            rank, epoch, index = (int(v) for v in line.split())
            reads[(rank, epoch)].append(index)
    assert set(reads) == {(0, 1), (1, 1)}  # one epoch, two ranks
    zero, one = reads[(0, 1)], reads[(1, 1)]
    assert len(zero) == len(set(zero)) and len(one) == len(set(one))  # no sample twice on a rank
    assert not set(zero) & set(one)  # disjoint shares
    # Each rank's whole batches: 256 samples over 2 ranks of 32 -> 4 steps each, nothing left over.
    assert len(zero) == len(one) == 128 and set(zero) | set(one) == set(range(256))
    assert read_metrics(tmp_path / "run")["steps"] == 4 and read_metrics(tmp_path / "run")["world_size"] == 2


@pytest.mark.slow  # slow: the fast suite's budget (make test <= 120 s on 2 cores); CI runs it in make test-slow
@pytest.mark.parametrize("how", ["SIGTERM to the process", "Ctrl-C to the group"])
def test_a_stopped_conversion_removes_its_staging_folder_and_workers(how: str, source: Path, tmp_path: Path) -> None:
    """About 4 s each. SIGTERM used to end the converter on the spot, and Ctrl-C ended it with status 0 (LitData's
    own SIGINT handler): either way its staging folder stayed in /tmp."""
    (tmp_path / "tmp").mkdir()
    with slowed_conversion(source, tmp_path / "out", tmp_path / "tmp") as proc:
        folder = staging_folder(proc)
        deadline = time.monotonic() + 60
        while len(workers := psutil.Process(proc.pid).children(recursive=True)) < 2:  # LitData's workers run
            assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read().decode()
            time.sleep(0.05)
        time.sleep(0.5)  # into their images
        assert folder.is_dir()
        if how.startswith("SIGTERM"):
            os.kill(proc.pid, signal.SIGTERM)  # as `kill PID` or a scheduler does: the converter alone
        else:
            os.killpg(proc.pid, signal.SIGINT)  # as Ctrl-C in a terminal: the whole foreground group
        err = proc.communicate(timeout=30)[1].decode()
    assert proc.returncode == (143 if how.startswith("SIGTERM") else 130), err
    assert "stopped: " in err and "Traceback" not in err
    assert not folder.exists() and not [p for p in workers if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    # Stopped, not left to finish: a worker writes its chunk when its share is done (seconds after the stop here).
    assert not list((tmp_path / "out" / "train").glob("chunk-*")), "the workers went on packing after the stop"


@pytest.mark.slow  # a conversion slowed down and killed, then run again: about 15 s
def test_a_conversion_killed_with_sigkill_never_looks_complete_and_resumes(source: Path, tmp_path: Path) -> None:
    dst, tmp = tmp_path / "out", tmp_path / "tmp"
    tmp.mkdir()
    # The converter with its validation images slowed down, so the kill lands after the train split is finished
    # and during the val split.
    with slowed_conversion(source, dst, tmp, slowed="/val/", workers=1) as proc:
        folder = staging_folder(proc)  # said on its first line
        partial = dst / PARTIAL
        deadline = time.monotonic() + 120
        while not (partial.exists() and '"train"' in partial.read_text()):  # the train split is recorded as done
            assert proc.poll() is None and time.monotonic() < deadline, "the conversion ended before the kill"
            time.sleep(0.05)
        time.sleep(0.5)  # into the val split
        os.killpg(proc.pid, signal.SIGKILL)  # no handler runs: whatever is on disk stays as it is
        proc.wait(timeout=30)
    assert not (dst / MANIFEST).exists() and partial.exists() and folder.is_dir()
    result = subprocess.run(
        [sys.executable, "-m", "imgtrain.data.shards.convert", str(source), str(dst)],
        capture_output=True,
        text=True,
        env={**os.environ, "TMPDIR": str(tmp)},
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert "resuming an unfinished conversion" in result.stdout and "keeping train as written" in result.stdout
    assert f"staging in {folder} (removed when the conversion ends, after removing what a killed" in result.stdout
    assert not folder.exists()
    manifest = json.loads((dst / MANIFEST).read_text())
    assert (manifest["splits"]["train"]["samples"], manifest["splits"]["val"]["samples"]) == (256, 64)


@pytest.mark.slow  # a multirun of real train.py processes with a tune probe: about 40 s
def test_a_worker_sweep_on_shards_reports_and_tune_chooses(shards: Path, tmp_path: Path, data_dir: Path) -> None:
    sweep = tmp_path / "sweep"
    args = ["-m", *shards_args(shards, "data.tune_budget_s=3", "train.max_steps=24", "train.epochs=3")]
    args += ["data.num_workers=0,tune", f"hydra.sweep.dir={sweep}"]
    result = run_train(args, sweep / "unused", data_dir, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    with open(sweep / "sweep_summary.csv") as f:
        rows = list(csv.DictReader(f))
    assert [row["status"] for row in rows] == ["ok", "ok"] and all(float(row["images_per_sec"]) > 0 for row in rows)
    tuned = json.loads((sweep / "1" / "loader_args.json").read_text())["tune"]
    assert tuned["chosen"] in (0, 1, 2) and len(tuned["table"]) >= 2
    assert "Fastest here:" in result.stdout or "Tied within noise:" in result.stdout, result.stdout[-2000:]
