"""Tests for imgtrain.metrics.memory: the smaps_rollup parser, PSS/USS reads, the copy-on-write growth detector,
the PSS cadence, and a real measurement of PSS against RSS with forked DataLoader workers."""

from __future__ import annotations

import logging
import os
import random
import signal
import subprocess
import sys
import time

import numpy as np
import psutil
import pytest
import torch
from torch.utils.data import DataLoader, Dataset

from imgtrain.metrics import memory
from imgtrain.metrics.memory import (
    MB,
    CowGrowthDetector,
    ProcMemory,
    TreeMemory,
    forked_children,
    parse_smaps_rollup,
    read_memory,
)
from imgtrain.metrics.monitor import PSS_KEY, ResourceMonitor

linux_only = pytest.mark.skipif(not memory.HAS_PSS, reason="PSS exists on Linux only")

ROLLUP = """\
55c711ee6000-7ffd8740f000 ---p 00000000 00:00 0                          [rollup]
Rss:                1592 kB
Pss:                 372 kB
Pss_Anon:            112 kB
Shared_Clean:       1436 kB
Shared_Dirty:          0 kB
Private_Clean:        44 kB
Private_Dirty:       112 kB
Swap:                  0 kB
"""


def test_parse_smaps_rollup():
    fields = parse_smaps_rollup(ROLLUP)
    assert fields["Rss"] == 1592 * 1024 and fields["Pss"] == 372 * 1024
    assert fields["Private_Clean"] == 44 * 1024 and fields["Private_Dirty"] == 112 * 1024
    assert fields["Swap"] == 0
    assert not any(key.startswith("55c7") for key in fields)  # the address header ("00:00") is no field


def test_read_memory_uses_pss_and_private_fields(monkeypatch: pytest.MonkeyPatch, tmp_path):
    fake = tmp_path / "123"
    fake.mkdir()
    (fake / "smaps_rollup").write_text(ROLLUP)
    monkeypatch.setattr(memory, "HAS_SMAPS_ROLLUP", True)
    assert read_memory(123, procfs=str(tmp_path)) == ProcMemory(pss=372 * 1024, uss=(44 + 112) * 1024)
    assert read_memory(124, procfs=str(tmp_path)) is None  # no such process


@linux_only
def test_pss_of_this_process_is_positive_and_at_most_rss():
    mem = read_memory(os.getpid())
    rss = psutil.Process().memory_info().rss
    assert mem is not None
    assert 0 < mem.uss <= mem.pss <= rss, (mem, rss)


def test_no_pss_off_linux(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(memory, "HAS_SMAPS_ROLLUP", False)
    monkeypatch.setattr(memory, "HAS_PSS", False)
    assert read_memory(os.getpid()) is None
    assert not TreeMemory().due(0.0, [])
    with ResourceMonitor(torch.device("cpu"), interval_s=0.02) as mon:
        mon._sample(pss=True)
        assert mon.summary()["pss_peak_gb"] is None  # null in metrics.json, not 0


# ---------------------------------------------------------------- the copy-on-write growth detector


def _feed(detector: CowGrowthDetector, pid: int, values_mb: list[float], every_s: float = 5.0) -> list[str]:
    messages = [detector.add(i * every_s, pid, int(v * MB)) for i, v in enumerate(values_mb)]
    return [m for m in messages if m]


def test_cow_detector_warns_once_for_steady_growth():
    rng = random.Random(0)
    growing = [300 + 25 * i + rng.uniform(-3, 3) for i in range(20)]  # +25 MB every 5 s
    detector = CowGrowthDetector()
    messages = _feed(detector, 4242, growing)
    assert len(messages) == 1  # once, though the series keeps qualifying
    text = messages[0]
    assert "pid 4242" in text and "copy-on-write" in text and "numpy" in text and "13246" in text
    assert " MB over " in text and " s (" in text
    assert _feed(detector, 4343, growing) == []  # once per run, not once per worker


@pytest.mark.parametrize(
    "values_mb",
    [
        [300 + random.Random(1).uniform(-60, 60) for _ in range(40)],  # flat and noisy
        [300] * 5 + [600] * 30,  # one step up (an allocation), then flat
        [300] * 10 + [900] + [300] * 10,  # one spike
        [300 + i for i in range(40)],  # rising on every step, but only 39 MB in all (< 64 MB)
    ],
)
def test_cow_detector_quiet_for_flat_or_noisy_series(values_mb: list[float]):
    assert _feed(CowGrowthDetector(), 7, values_mb) == []


def test_cow_detector_needs_enough_samples_and_time():
    steep = [300 + 200 * i for i in range(8)]
    assert _feed(CowGrowthDetector(), 7, steep, every_s=1.0) == []  # 7 s < 30 s
    assert _feed(CowGrowthDetector(), 7, steep[:4], every_s=20.0) == []  # 4 samples < 6
    assert len(_feed(CowGrowthDetector(), 7, steep, every_s=5.0)) == 1


def test_cow_detector_keeps_series_apart_and_forgets_exited_workers():
    detector = CowGrowthDetector(max_kept=8)
    for i in range(20):
        detector.add(i * 5.0, 1, 300 * MB)
        detector.add(i * 5.0, 2, (300 + 40 * i) * MB)
    assert detector.warned
    assert len(detector.series[1]) <= 8 and detector.series[1][0][0] == 0.0  # thinned, first sample kept
    assert detector.series[2][-1][0] == 95.0
    detector.retain({2})
    assert set(detector.series) == {2}


# ---------------------------------------------------------------- cadence and the tree


def test_tree_memory_cadence(monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture):
    monkeypatch.setattr(memory, "HAS_PSS", True)
    uss = {10: 100 * MB, 11: 100 * MB, 12: 100 * MB}
    monkeypatch.setattr(memory, "read_memory", lambda pid: ProcMemory(pss=50 * MB, uss=uss[pid]))
    tree = TreeMemory()
    assert tree.due(0.0, [])
    assert tree.sample(0.0, 10, [11], forked={11}) == 100 * MB
    assert not tree.due(1.0, [11])  # the next regular sample is 5 s later
    assert tree.due(1.5, [11, 12])  # a new worker: an early sample, >= 1 s after the last
    assert not tree.due(0.5, [11, 12])
    assert tree.due(1.5, [11], final=True) and not tree.due(0.5, [11], final=True)
    assert tree.due(5.0, [11])
    caplog.set_level(logging.WARNING, logger="imgtrain.metrics.memory")
    for i in range(1, 12):  # both grow; only the forked one may warn
        uss[11] = uss[12] = (100 + 50 * i) * MB
        tree.sample(5.0 * i, 10, [11, 12], forked={11})
    assert [r.getMessage().split(":")[0] for r in caplog.records] == ["DataLoader worker pid 11"]
    assert set(tree.detector.series) == {11}


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="fork")
def test_forked_children_are_told_from_spawned_programs():
    pid = os.fork()
    if pid == 0:  # the child: the same command line, no exec
        time.sleep(30)
        os._exit(0)
    program = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        children = [psutil.Process(pid), psutil.Process(program.pid)]
        assert forked_children(psutil.Process(), children) == {pid}
    finally:
        program.kill()
        program.wait()
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)


class _Shared(Dataset):
    """~50 MB in one numpy array, read (never written) by every item: shared, not copied, by forked workers."""

    def __init__(self) -> None:
        self.array = np.ones(50 * MB, dtype=np.uint8)

    def __len__(self) -> int:
        return 8

    def __getitem__(self, index: int) -> torch.Tensor:
        return torch.tensor(int(self.array.sum()))


@linux_only
def test_pss_of_forked_workers_is_below_their_rss_sum():
    loader = DataLoader(_Shared(), batch_size=1, num_workers=2, multiprocessing_context="fork")
    with ResourceMonitor(torch.device("cpu"), interval_s=60.0) as mon:
        batches = iter(loader)
        next(batches), next(batches)  # both workers have read the whole array
        sample = mon._sample(pss=True)
        workers = len(mon._children)
        del batches
    assert workers >= 2
    # The array alone is in all three RSS figures (150 MB) but in the PSS sum once (50 MB); torch's pages
    # shared with the workers add much more.
    assert sample[PSS_KEY] < sample["sys/rss_gb"] - 0.1, sample
    assert sample[PSS_KEY] > 0.05  # at least the array
