"""Tests for imgtrain.metrics.monitor (ResourceMonitor, NVML device mapping) and imgtrain.metrics.tensorboard
(MetricsLogger)."""

from __future__ import annotations

import contextlib
import logging
import subprocess
import sys
import time
import types
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from imgtrain.metrics import memory
from imgtrain.metrics import monitor as monitor_mod
from imgtrain.metrics.monitor import ResourceMonitor, nvml_index_for, parse_visible_devices
from imgtrain.metrics.tensorboard import MetricsLogger, flatten_hparams

UUIDS = [
    "GPU-aaaa1111-0000-0000-0000-000000000000",
    "GPU-bbbb2222-0000-0000-0000-000000000000",
    "GPU-bbbb3333-0000-0000-0000-000000000000",
]


def _nvml_notes(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [r for r in caplog.records if "gpu/util_pct" in r.getMessage()]


# ---------------------------------------------------------------- device mapping (pure functions)


@pytest.mark.parametrize(
    ("torch_index", "env", "torch_uuid", "expected"),
    [
        (1, None, None, 1),  # nothing set: identity
        (0, "2,0", None, 2),
        (1, "2,0", None, 0),
        (2, "2,0", None, None),  # beyond the visible list
        (0, " 1 , 2", None, 1),  # whitespace tolerated
        (1, "0,foo,1", None, None),  # an invalid entry ends the list, as in CUDA
        (0, "1,1", None, None),  # a repeated ordinal hides every device
        (0, "5", None, None),  # no such NVML device
        (0, "", None, None),  # no device visible
        (0, UUIDS[2], None, 2),  # full UUID string
        (1, f"{UUIDS[2]},{UUIDS[0]}", None, 0),
        (0, "GPU-aaaa", None, 0),  # unique UUID prefix
        (0, "GPU-bbbb", None, None),  # ambiguous prefix
        (0, "MIG-aaaa1111-0000", None, None),  # MIG instance: not resolvable to a physical GPU
        # torch's UUID wins over CUDA_VISIBLE_DEVICES, with or without the "GPU-" prefix.
        (0, "0", "bbbb3333-0000-0000-0000-000000000000", 2),
        (0, None, UUIDS[1].upper(), 1),
        (0, "0", "cccc0000-0000-0000-0000-000000000000", None),  # unknown UUID (e.g. MIG): give up
    ],
)
def test_nvml_index_for(torch_index: int, env: str | None, torch_uuid: str | None, expected: int | None):
    assert nvml_index_for(torch_index, env, UUIDS, torch_uuid) == expected


def test_nvml_index_for_accepts_bytes_uuids():
    as_bytes = [u.encode() for u in UUIDS]
    assert nvml_index_for(0, None, as_bytes, UUIDS[2][4:]) == 2
    assert nvml_index_for(0, UUIDS[1], as_bytes) == 1


def test_parse_visible_devices():
    assert parse_visible_devices(None, 3) == [0, 1, 2]
    assert parse_visible_devices("3,1", 4) == [3, 1]
    assert parse_visible_devices("GPU-a,GPU-b,0", 4) == ["GPU-a", "GPU-b"]


# ---------------------------------------------------------------- ResourceMonitor on CPU


def test_cpu_monitor_sys_keys(caplog: pytest.LogCaptureFixture):
    caplog.set_level(logging.INFO, logger="imgtrain.metrics.monitor")
    with ResourceMonitor(torch.device("cpu"), interval_s=0.05) as mon:
        assert mon.gpu_available is False
        time.sleep(0.3)
        win = mon.window()
        pss = {monitor_mod.PSS_KEY} if memory.HAS_PSS else set()  # the thread's first sample has PSS (Linux)
        assert set(win) == {"sys/cpu_pct", "sys/proc_cpu_pct", "sys/rss_gb", *pss}
        assert 0.0 <= win["sys/cpu_pct"] <= 100.0
        assert 0.0 <= win["sys/proc_cpu_pct"] <= 100.0
        assert 0.01 < win["sys/rss_gb"] < 100.0  # a python process with torch is > 10 MB
        if pss:
            assert 0.0 < win[monitor_mod.PSS_KEY] <= win["sys/rss_gb"]
        second = mon.window()  # fresh sample when nothing new arrived: no PSS on this (the calling) thread
        assert set(second) == set(monitor_mod.SYS_KEYS)
        summ = mon.summary()
    assert summ["gpu_util_mean"] is None
    assert summ["gpu_mem_used_max_gb"] is None
    assert summ["num_samples"] >= 3  # start sample + thread samples over 0.3 s
    assert summ["rss_peak_gb"] >= win["sys/rss_gb"] * 0.9
    if pss:
        assert 0.0 < summ["pss_peak_gb"] <= summ["rss_peak_gb"]
    assert 0.0 <= summ["proc_cpu_pct_mean"] <= 100.0
    assert len(_nvml_notes(caplog)) <= 1
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]  # CPU is not a problem


def test_stop_is_prompt_idempotent_and_reset_summary():
    mon = ResourceMonitor(torch.device("cpu"), interval_s=60.0).start()
    assert mon.summary()["num_samples"] == 1  # the immediate sample from start()
    mon.window()
    mon.window()
    assert mon.summary()["num_samples"] == 2
    mon.reset_summary()
    assert mon.summary()["num_samples"] == 1  # empty after reset -> one fresh sample
    assert set(mon.window()) == set(monitor_mod.SYS_KEYS)  # that sample also went to the window
    t0 = time.monotonic()
    mon.stop()
    mon.stop()
    assert time.monotonic() - t0 < 2.0  # did not wait for the 60 s interval
    assert mon._thread is not None and not mon._thread.is_alive()
    assert mon._thread.daemon
    assert mon.window() == {}  # nothing left and no sampling after stop
    if memory.HAS_PSS:  # the thread's last act: one PSS sample, for the summary only
        assert mon.summary()["pss_peak_gb"] > 0.0


def test_memory_peaks_outlive_reset_summary():
    mon = ResourceMonitor(torch.device("cpu"), interval_s=60.0)
    mon._record({"sys/cpu_pct": 90.0, "sys/rss_gb": 3.0, monitor_mod.PSS_KEY: 2.0})
    mon.reset_summary()  # end of warm-up: means restart, memory peaks do not
    mon._record({"sys/cpu_pct": 10.0, "sys/rss_gb": 1.0})
    summ = mon.summary()
    assert summ["cpu_pct_mean"] == 10.0 and summ["num_samples"] == 1
    assert summ["rss_peak_gb"] == 3.0 and summ["pss_peak_gb"] == 2.0


@contextlib.contextmanager
def _child(code: str) -> Iterator[subprocess.Popen[str]]:
    """Run `code` in a child python that prints "ready" once set up; kill it afterwards."""
    with subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True) as child:
        try:
            assert child.stdout is not None and child.stdout.readline().strip() == "ready"
            yield child
        finally:
            child.kill()


def test_rss_includes_children():
    alloc = "import time; b=bytearray(300_000_000); b[::4096]=b'x'*len(b[::4096]); print('ready', flush=True)"
    with ResourceMonitor(torch.device("cpu"), interval_s=60.0) as mon:
        mon.window()  # drains the start() sample
        before = mon.window()["sys/rss_gb"]
        with _child(alloc + "; time.sleep(30)"):
            after = mon.window()["sys/rss_gb"]
        assert 0.25 < after - before < 0.6, (before, after)
        assert mon.summary()["rss_peak_gb"] >= after


def test_proc_cpu_includes_children():
    busy_loop = "import time; print('ready', flush=True)\nt = time.time() + 30\nwhile time.time() < t: pass"
    with ResourceMonitor(torch.device("cpu"), interval_s=60.0) as mon, _child(busy_loop):
        mon.window()  # drains the start() sample
        mon.window()  # fresh sample: registers the child (its first cpu_percent call returns 0)
        time.sleep(1.0)
        busy = mon.window()["sys/proc_cpu_pct"]
    # ~One busy core (100 in single-core units); cpu_percent needs the cached Process object for this.
    assert busy * mon._ncpus > 25.0, busy


# ---------------------------------------------------------------- ResourceMonitor with a fake NVML


class _FakeNVMLError(Exception):
    pass


def _fake_pynvml(util: list[int], used: list[float], fail_init: bool = False) -> types.ModuleType:
    mod = types.ModuleType("pynvml")
    mod.NVMLError = _FakeNVMLError
    mod.calls = {"init": 0, "shutdown": 0}

    def init():
        mod.calls["init"] += 1
        if fail_init:
            raise _FakeNVMLError("Driver Not Loaded")

    def shutdown():
        mod.calls["shutdown"] += 1

    mod.nvmlInit = init
    mod.nvmlShutdown = shutdown
    mod.nvmlDeviceGetCount = lambda: len(util)
    mod.nvmlDeviceGetHandleByIndex = lambda i: ("handle", i)
    mod.nvmlDeviceGetUUID = lambda h: UUIDS[h[1]].encode()
    mod.nvmlDeviceGetUtilizationRates = lambda h: types.SimpleNamespace(gpu=util[h[1]], memory=0)
    mod.nvmlDeviceGetMemoryInfo = lambda h: types.SimpleNamespace(used=used[h[1]], total=80e9, free=0)
    return mod


def _patch_torch_props(monkeypatch: pytest.MonkeyPatch, uuid: str | None) -> list[int]:
    calls: list[int] = []

    def props(index: int):
        calls.append(index)
        return types.SimpleNamespace(name="fake") if uuid is None else types.SimpleNamespace(uuid=uuid)

    monkeypatch.setattr(torch.cuda, "get_device_properties", props)
    return calls


def test_fake_nvml_maps_device_by_uuid(monkeypatch: pytest.MonkeyPatch):
    fake = _fake_pynvml(util=[11, 77, 33], used=[1e9, 12.5e9, 3e9])
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1,2")  # would say device 0: the UUID must win
    prop_calls = _patch_torch_props(monkeypatch, UUIDS[1][4:])  # torch reports UUIDs without "GPU-"
    mon = ResourceMonitor(torch.device("cuda", 0), interval_s=0.02)
    assert mon.gpu_available
    n_prop_calls = len(prop_calls)
    with mon:
        time.sleep(0.1)
        win = mon.window()
        assert win["gpu/util_pct"] == pytest.approx(77.0)
        assert win["gpu/mem_used_gb"] == pytest.approx(12.5)
        summ = mon.summary()
    assert summ["gpu_util_mean"] == pytest.approx(77.0)
    assert summ["gpu_mem_used_max_gb"] == pytest.approx(12.5)
    assert len(prop_calls) == n_prop_calls  # sampling never touched torch.cuda
    assert fake.calls == {"init": 1, "shutdown": 1}


def test_fake_nvml_falls_back_to_visible_devices(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setitem(sys.modules, "pynvml", _fake_pynvml(util=[11, 77, 33], used=[1e9, 2e9, 3e9]))
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,0")
    _patch_torch_props(monkeypatch, None)  # no .uuid property
    with ResourceMonitor(torch.device("cuda", 1), interval_s=60.0) as mon:
        assert mon.window()["gpu/util_pct"] == pytest.approx(11.0)


@pytest.mark.parametrize("fail", ["init", "import", "mig"])
def test_nvml_unavailable_is_logged_once(monkeypatch: pytest.MonkeyPatch, caplog, fail: str):
    caplog.set_level(logging.INFO, logger="imgtrain.metrics.monitor")
    fake = _fake_pynvml(util=[11], used=[1e9], fail_init=fail == "init")
    monkeypatch.setitem(sys.modules, "pynvml", None if fail == "import" else fake)  # None -> ImportError
    _patch_torch_props(monkeypatch, "MIG-1234" if fail == "mig" else UUIDS[0])
    with ResourceMonitor(torch.device("cuda", 0), interval_s=0.02) as mon:
        time.sleep(0.1)
        wins = [mon.window() for _ in range(3)]
        summ = mon.summary()
    assert mon.gpu_available is False
    assert all(set(w) - {monitor_mod.PSS_KEY} == {"sys/cpu_pct", "sys/proc_cpu_pct", "sys/rss_gb"} for w in wins)
    assert summ["gpu_util_mean"] is None and summ["gpu_mem_used_max_gb"] is None
    notes = _nvml_notes(caplog)
    assert len(notes) == 1 and notes[0].levelno == logging.WARNING
    assert "NVML unavailable" in notes[0].getMessage()
    if fail == "mig":
        assert fake.calls == {"init": 1, "shutdown": 1}  # released right away


def test_nvml_query_failure_mid_run_disables_gpu_keys(monkeypatch: pytest.MonkeyPatch, caplog):
    fake = _fake_pynvml(util=[50], used=[1e9])
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    _patch_torch_props(monkeypatch, UUIDS[0])
    mon = ResourceMonitor(torch.device("cuda", 0), interval_s=60.0).start()
    assert "gpu/util_pct" in mon.window()

    def broken(handle):
        raise _FakeNVMLError("GPU is lost")

    monkeypatch.setattr(fake, "nvmlDeviceGetUtilizationRates", broken)
    assert "gpu/util_pct" not in mon.window()
    assert "gpu/util_pct" not in mon.window()
    assert mon.summary()["gpu_util_mean"] == pytest.approx(50.0)  # mean over the samples that had it
    mon.stop()
    assert len([r for r in caplog.records if "NVML query failed" in r.getMessage()]) == 1


def test_monitor_module_does_not_import_pynvml_for_cpu(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setitem(sys.modules, "pynvml", _fake_pynvml(util=[1], used=[1.0]))
    with ResourceMonitor(torch.device("cpu"), interval_s=60.0) as mon:
        assert not mon.gpu_available and mon._nvml is None
    assert monitor_mod.SYS_KEYS == ("sys/cpu_pct", "sys/proc_cpu_pct", "sys/rss_gb")


# ---------------------------------------------------------------- MetricsLogger


def _accumulator(path: Path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    ea = EventAccumulator(str(path))
    ea.Reload()
    return ea


def test_metrics_logger_scalars_and_hparams(tmp_path: Path):
    tb = tmp_path / "tb"
    logger = MetricsLogger(str(tb))
    logger.log({"train/loss": 2.5, "train/img_per_s": 1000, "gpu/util_pct": None}, step=1)
    logger.log({"train/loss": 1.5}, step=2)
    hp = {"optim": {"lr": 0.1, "nesterov": True}, "data": {"workers": 4, "root": None}, "aug": [1, 2]}
    logger.log_hparams(hp, {"final/val_acc": 0.75, "final/gpu_util_mean": None})
    logger.close()
    logger.close()  # idempotent

    assert [p.parent for p in tb.rglob("events.out.tfevents.*")] == [tb]  # no timestamped sub-run
    ea = _accumulator(tb)
    scalars = ea.Tags()["scalars"]
    assert {"train/loss", "train/img_per_s", "final/val_acc"} <= set(scalars)
    assert "gpu/util_pct" not in scalars and "final/gpu_util_mean" not in scalars
    assert [(e.step, e.value) for e in ea.Scalars("train/loss")] == [(1, 2.5), (2, 1.5)]
    assert ea.Scalars("final/val_acc")[0].value == pytest.approx(0.75)

    from tensorboard.plugins.hparams import plugin_data_pb2

    content = ea.PluginTagToContent("hparams")
    assert {"_hparams_/experiment", "_hparams_/session_start_info"} <= set(content)
    start = plugin_data_pb2.HParamsPluginData.FromString(content["_hparams_/session_start_info"])
    hparams = start.session_start_info.hparams
    assert hparams["optim.lr"].number_value == pytest.approx(0.1)
    assert hparams["data.workers"].number_value == 4
    assert hparams["data.root"].string_value == "null"
    assert hparams["aug"].string_value == "[1, 2]"
    exp = plugin_data_pb2.HParamsPluginData.FromString(content["_hparams_/experiment"]).experiment
    assert {m.name.tag for m in exp.metric_infos} == {"final/val_acc", "final/gpu_util_mean"}


def test_flatten_hparams_types():
    import numpy as np

    flat = flatten_hparams({"a": {"b": np.int64(3), "c": np.float32(0.5)}, "d": (1, "x"), "e": False})
    assert flat == {"a.b": 3, "a.c": 0.5, "d": "[1, 'x']", "e": False}
    assert type(flat["a.b"]) is int and type(flat["a.c"]) is float


def test_metrics_logger_disabled_creates_nothing(tmp_path: Path):
    tb = tmp_path / "tb"
    logger = MetricsLogger(str(tb), enabled=False)
    logger.log({"train/loss": 1.0}, step=1)
    logger.log_hparams({"lr": 0.1}, {"final/val_acc": 0.5})
    logger.close()
    assert not tb.exists()
    assert list(tmp_path.iterdir()) == []
