"""A real `python train.py` subprocess on CPU: console, metrics.json, loader args and TensorBoard tags."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers import FAST, read_metrics, run_train
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from imgtrain.metrics import memory
from imgtrain.metrics.summary import FIELDS

EXPECTED_TAGS = {
    "train/loss",
    "train/acc",
    "val/loss",
    "val/acc",
    "lr",
    "perf/images_per_sec",
    "perf/data_wait_frac",
    "perf/step_time_ms",
    "sys/cpu_pct",
    "sys/rss_gb",
    "pipeline/read_ms_per_image",
    "pipeline/decode_ms_per_image",
    "pipeline/augment_ms_per_image",
    "pipeline/collate_ms_per_batch",
    "pipeline/transfer_ms_per_batch",
    "pipeline/worker_busy_frac",
}


@pytest.fixture(scope="module")
def smoke_run(tmp_path_factory: pytest.TempPathFactory, data_dir: Path) -> tuple[Path, object]:
    run_dir = tmp_path_factory.mktemp("smoke") / "run"
    result = run_train([*FAST, "data.prefetch_factor=4", "train.epochs=2"], run_dir, data_dir)  # an epoch start
    assert result.returncode == 0, result.stderr[-3000:]
    return run_dir, result


def test_run_prints_summary_table(smoke_run) -> None:
    _, result = smoke_run
    assert "Run summary" in result.stdout
    assert "images/s (steady state)" in result.stdout and "95% interval of the median window" in result.stdout
    assert "epoch start" in result.stdout and "each later start costs" in result.stdout
    assert "PSS peak incl. workers (GB)" in result.stdout
    assert "Traceback" not in result.stderr
    assert "pre-flight: /dev/shm" in result.stdout  # the checks' summary line (warnings, if any, come before it)


def test_effective_loader_args_are_logged_and_saved(smoke_run) -> None:
    run_dir, result = smoke_run
    saved = json.loads((run_dir / "loader_args.json").read_text())
    assert saved["train"]["num_workers"] == 1 and saved["train"]["prefetch_factor"] == 4
    assert saved["train"]["pin_memory"] is False  # no CUDA here
    assert saved["val"]["drop_last"] is False
    assert "DataLoader (train): batch_size=32 num_workers=1" in result.stdout
    assert "DataLoader (train): batch_size=32 num_workers=1" in (run_dir / "train.log").read_text()


def test_metrics_json_holds_the_final_summary(smoke_run) -> None:
    run_dir, _ = smoke_run
    metrics = read_metrics(run_dir)
    assert list(metrics) == list(FIELDS)  # exactly metrics.summary.RunSummary's fields, in its order
    assert metrics["status"] == "ok"
    assert metrics["images_per_sec"] > 0
    assert 0.0 <= metrics["data_wait_frac"] <= 1.0
    assert metrics["gpu_util_mean"] is None  # CPU run
    assert 0.0 < metrics["main_thread_busy_frac"] <= 1.0  # the training thread's CPU over wall seconds
    assert metrics["compile_mode"] is None  # eager
    assert 0.0 <= metrics["val_acc"] <= 1.0 and metrics["val_count"] == 64
    assert metrics["loader"]["batch_size"] == 32 and metrics["loader"]["num_workers"] == 1
    assert metrics["world_size"] == 1 and metrics["device"] == "cpu"
    assert metrics["torch_version"] and metrics["cpu_count"] >= 1
    assert metrics["steps"] == 16  # 256 images / 32 per batch, two epochs
    assert metrics["measured_steps"] == 14  # 16 steps minus 2 warm-up steps
    assert len(metrics["images_per_sec_windows"]) == 7  # steps 3-4, 5-6, 7-8, then 9-10 ... 15-16
    low, high = metrics["images_per_sec_interval"]  # 7 windows: an interval of the median
    assert low <= metrics["images_per_sec_median"] <= high and metrics["images_per_sec_interval_note"] is None
    assert len(metrics["epoch_first_batch_s"]) == 2 and all(s > 0 for s in metrics["epoch_first_batch_s"])
    assert len(metrics["epoch_start_cost_s"]) == 1 and metrics["epoch_start_cost_frac"] is not None
    assert metrics["rss_peak_gb"] > 0.1
    assert metrics["profile_trace"] is None  # metrics.profile=false: no trace
    env = metrics["environment"]  # the pre-flight fingerprint (imgtrain.metrics.preflight)
    assert env["torch"] == metrics["torch_version"] and env["torchvision"] == metrics["torchvision_version"]
    assert env["python"].count(".") == 2 and env["cpus_available"] >= 1 and env["gpu_name"] is None
    assert env["decoder"]["in_use"].startswith("torchcodec (JPEG, PNG, WebP, GIF)") and env["decoder"]["pillow"]
    assert isinstance(env["warnings"], list) and env["data_root"].endswith("shapes")
    assert env["probe_ms"] < 1000  # cheap: 4 to 14 ms on a busy 2-core machine
    if memory.HAS_PSS:  # Linux: shared pages counted once, so below RSS, which counts them in every process
        assert 0.0 < metrics["pss_peak_gb"] < metrics["rss_peak_gb"]
    else:
        assert metrics["pss_peak_gb"] is None


def test_the_run_reports_where_its_input_time_went(smoke_run) -> None:
    run_dir, result = smoke_run
    pipeline = read_metrics(run_dir)["pipeline"]
    per_image = pipeline["stage_ms_per_image"]
    assert all(per_image[stage] > 0 for stage in ("read", "decode", "augment", "collate"))
    assert per_image["h2d"] is None and per_image["gpu_decode"] is None  # a CPU device: no copy, no GPU decode
    assert pipeline["workers"] == 1 and 0 < pipeline["worker_busy_frac"] <= 1
    assert pipeline["compute_images_per_sec"] is None  # debug=fast turns the contention probe off
    assert "input stages (ms per image)  read " in result.stdout and "loading busy" in result.stdout


def test_tensorboard_has_the_tags(smoke_run) -> None:
    run_dir, _ = smoke_run
    events = EventAccumulator(str(run_dir / "tb"))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    assert tags >= EXPECTED_TAGS, EXPECTED_TAGS - tags
    assert ("sys/pss_gb" in tags) == memory.HAS_PSS  # the monitor thread's first sample has PSS (Linux only)
    assert not any(tag.startswith("gpu/") for tag in tags)  # no NVIDIA GPU: the gpu tags are absent
    throughput_steps = [event.step for event in events.Scalars("perf/images_per_sec")]
    assert min(throughput_steps) > 2  # warm-up steps are never reported as throughput
    assert [event.step for event in events.Scalars("val/acc")] == [8, 16]
    assert [event.step for event in events.Scalars("time/epoch_first_batch_s")] == [2, 10]  # each epoch's first window
    assert [event.step for event in events.Scalars("time/epoch_start_cost_s")] == [10]  # after this process's first


def test_tensorboard_hparams_in_the_same_run(smoke_run) -> None:
    run_dir, _ = smoke_run
    events = EventAccumulator(str(run_dir / "tb"))
    events.Reload()
    content = events.PluginTagToContent("hparams")
    assert content, "no HParams plugin data"
    assert [p.name for p in (run_dir / "tb").iterdir() if p.is_dir()] == []  # no timestamped subfolder
    assert "hparam/images_per_sec" in events.Tags()["scalars"]
