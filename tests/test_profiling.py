"""metrics.profile=true: the Profiler component on a toy workload, and one real run (slow) with the loop's ranges."""

from __future__ import annotations

import contextlib
import gzip
import json
import logging
from pathlib import Path

import pytest
import torch
from helpers import FAST, compose_cfg

from imgtrain.config.metrics import MetricsConfig
from imgtrain.host.dist import DistInfo
from imgtrain.metrics.profiling import PREFIX, RANGES, Profiler, no_range
from imgtrain.train.run import run

CPU = torch.device("cpu")


def _profiler(tmp_path: Path, steps_left: int, rank: int = 0, **measure) -> Profiler:
    settings = MetricsConfig(**{"profile": True, "skip_first_steps": 0, "profile_steps": 2, **measure})
    return Profiler(settings, CPU, DistInfo(rank=rank, world_size=rank + 1), tmp_path, steps_left=steps_left)


def _steps(profiler: Profiler, count: int) -> None:
    """`count` toy steps, each with every labelled range the loop marks."""
    for _ in range(count):
        for name in RANGES:
            with profiler.range(name):
                torch.ones(16, 16).matmul(torch.ones(16, 16))
        profiler.step()


def _names_in(trace: Path) -> set[str]:
    with gzip.open(trace, "rt") as file:
        return {event.get("name", "") for event in json.load(file)["traceEvents"]}


def test_off_the_ranges_are_one_shared_noop(tmp_path: Path) -> None:
    for profiler in (_profiler(tmp_path, 100, profile=False), _profiler(tmp_path, 100, rank=1)):  # off; rank 1
        with profiler:
            _steps(profiler, 4)
            assert isinstance(profiler.range("forward"), contextlib.nullcontext)
            assert profiler.range("forward") is profiler.range("h2d") is no_range("data_wait")  # nothing built
        assert profiler.trace is None
    assert not (tmp_path / "profile").exists()


def test_the_trace_holds_every_labelled_range(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    profiler = _profiler(tmp_path, steps_left=10)  # 0 wait + 1 profiler warm-up + 2 recorded steps
    with caplog.at_level(logging.INFO, logger="imgtrain.metrics.profiling"), profiler:
        _steps(profiler, 3)
        assert profiler.trace == str(tmp_path / "profile" / "trace_rank0.json.gz")
        assert isinstance(profiler.range("forward"), contextlib.nullcontext)  # written: ranges off from here
        _steps(profiler, 2)  # the rest of the run: no error, nothing rewritten
    names = _names_in(Path(profiler.trace))
    assert {PREFIX + name for name in RANGES} <= names
    assert {"ProfilerStep#1", "ProfilerStep#2"} <= names and "ProfilerStep#0" not in names  # #0: warm-up
    table = (tmp_path / "profile" / "top_ops_rank0.txt").read_text()
    assert "Self CPU" in table and "aten::mm" in table
    assert "https://ui.perfetto.dev" in caplog.text and "Self CPU" in caplog.text


def test_a_run_shorter_than_the_schedule_says_so_and_writes_nothing(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, logger="imgtrain.metrics.profiling"):
        profiler = _profiler(tmp_path, steps_left=5, skip_first_steps=2, profile_steps=3)  # needs 2 + 1 + 3
        with profiler:
            _steps(profiler, 5)
    assert "metrics.profile=true needs 6 steps" in caplog.text and "this run has 5 to go" in caplog.text
    assert profiler.trace is None and not (tmp_path / "profile").exists()


def test_a_run_stopped_while_recording_writes_nothing(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="imgtrain.metrics.profiling"):
        profiler = _profiler(tmp_path, steps_left=10, profile_steps=3)
        with pytest.raises(KeyboardInterrupt), profiler:
            _steps(profiler, 2)  # warm-up and one recorded step of three
            raise KeyboardInterrupt
    assert "stopped after 2 of 4 steps: no trace written" in caplog.text
    assert profiler.trace is None and not (tmp_path / "profile").exists()


def test_a_trace_that_cannot_be_written_costs_the_trace_only(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    (tmp_path / "profile").write_text("a file where the folder would go")
    with caplog.at_level(logging.WARNING, logger="imgtrain.metrics.profiling"):
        profiler = _profiler(tmp_path, steps_left=10)
        with profiler:
            _steps(profiler, 5)  # the training goes on
    assert "profiler: could not write" in caplog.text and "stopped after" not in caplog.text
    assert profiler.trace is None


def test_the_trace_and_table_replace_a_planted_link_never_write_through(tmp_path: Path) -> None:
    """profile/ is the run's own, but links sit at the trace's and the table's names (a directory others may
    write to): each file is written whole under a name of its own, then renamed over the link."""
    victim = tmp_path / "victim.txt"
    victim.write_text("precious\n")
    (tmp_path / "profile").mkdir()
    for name in ("trace_rank0.json.gz", "top_ops_rank0.txt"):
        (tmp_path / "profile" / name).symlink_to(victim)
    profiler = _profiler(tmp_path, steps_left=10)
    with profiler:
        _steps(profiler, 3)
    assert victim.read_text() == "precious\n"
    trace, table = Path(profiler.trace), tmp_path / "profile" / "top_ops_rank0.txt"
    assert not trace.is_symlink() and {PREFIX + name for name in RANGES} <= _names_in(trace)
    assert not table.is_symlink() and "aten::mm" in table.read_text()
    assert sorted(p.name for p in trace.parent.iterdir()) == ["top_ops_rank0.txt", "trace_rank0.json.gz"]


def test_the_profiled_steps_are_left_out_of_the_steady_state_on_every_rank(tmp_path: Path) -> None:
    """They run slower (every op recorded, then the trace written); rank 1 has no trace but waits for rank 0."""
    for rank in (0, 1):
        assert _profiler(tmp_path, steps_left=10, rank=rank, skip_first_steps=3).profiled_steps == 1 + 2
    assert _profiler(tmp_path, steps_left=5, skip_first_steps=3).profiled_steps == 0  # too short: no trace
    assert _profiler(tmp_path, steps_left=10, profile=False).profiled_steps == 0


@pytest.mark.slow  # trains: debug=fast, 16 steps (8 s on the 2-core VM, generating the shapes included)
def test_a_profiled_run_labels_the_loop(tmp_path: Path, data_dir: Path) -> None:
    run(compose_cfg(*FAST, "system.device=cpu", "metrics.profile=true", "train.epochs=2", output_dir=str(tmp_path)))
    metrics = json.loads((tmp_path / "metrics.json").read_text())
    # 16 steps, windows of 2: steps 1-2 warm up and 3-8 are profiled; images/s counts the 4 windows after them
    assert len(metrics["images_per_sec_windows"]) == 4
    trace = tmp_path / "profile" / "trace_rank0.json.gz"
    assert metrics["profile_trace"] == str(trace)
    names = _names_in(trace)
    assert {f"imgtrain/{name}" for name in ("data_wait", "h2d", "forward", "backward", "optimizer")} <= names
    assert "ProfilerStep#3" in names and "ProfilerStep#7" in names  # steps 4-8: after 2 warm-up + 1 profiler
    assert (tmp_path / "profile" / "top_ops_rank0.txt").read_text().count("aten::") >= 5


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device: run `make test-gpu` on a GPU")
def test_a_profiled_cuda_run_records_kernels(tmp_path: Path, data_dir: Path) -> None:
    run(compose_cfg(*FAST, "system.device=cuda", "metrics.profile=true", output_dir=str(tmp_path)))
    trace = tmp_path / "profile" / "trace_rank0.json.gz"
    with gzip.open(trace, "rt") as file:
        events = json.load(file)["traceEvents"]
    assert {PREFIX + name for name in RANGES} <= {event.get("name", "") for event in events}
    assert any(event.get("cat") == "kernel" for event in events)  # CUDA activity: the GPU's own timeline
    assert "CUDA" in (tmp_path / "profile" / "top_ops_rank0.txt").read_text()  # sorted by self CUDA time
