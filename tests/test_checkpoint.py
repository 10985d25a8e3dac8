"""Checkpoint files: atomic writes, damage detection, the verified fallback, and generator states."""

from __future__ import annotations

import logging
import os
import random
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from imgtrain import checkpoint
from imgtrain.checkpoint import CheckpointError, CheckpointStore
from imgtrain.errors import RunError


def _payload(step: int, size: int = 1000) -> dict:
    generator = torch.Generator().manual_seed(step)
    return {
        "format": checkpoint.FORMAT,
        "version": checkpoint.FORMAT_VERSION,
        "model": {"w": torch.randn(size, generator=generator)},
        "progress": {"step": step},
    }


def test_save_rotates_and_best_is_a_link_to_last(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path / "checkpoints", enabled=True)
    store.save(_payload(1))
    store.mark_best()
    store.save(_payload(2))
    assert checkpoint.load(store.last)["progress"]["step"] == 2
    assert checkpoint.load(store.prev)["progress"]["step"] == 1
    assert checkpoint.load(store.best)["progress"]["step"] == 1  # still the epoch that was best
    assert not list(store.directory.glob(".*.tmp"))


def test_disabled_store_writes_nothing(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path / "checkpoints", enabled=False)  # ranks other than 0
    store.save(_payload(1))
    assert not store.directory.exists()


@pytest.mark.parametrize("damage", ["truncate", "flip"])
def test_damage_is_detected(damage: str, tmp_path: Path) -> None:
    path = tmp_path / "last.pt"
    checkpoint.write_verified(_payload(1, size=100_000), path)
    data = bytearray(path.read_bytes())
    if damage == "truncate":
        data = data[: len(data) // 2]
    else:
        data[len(data) // 2] ^= 0xFF  # inside the tensor bytes: torch.load alone would not notice
    path.write_bytes(bytes(data))
    assert checkpoint.damage(path)
    with pytest.raises(CheckpointError):
        checkpoint.load(path)


def test_a_foreign_file_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "other.pt"
    torch.save({"state_dict": {}}, path)
    with pytest.raises(CheckpointError, match="not an imgtrain checkpoint"):
        checkpoint.load(path)


def test_damaged_last_falls_back_and_is_never_rotated_over_the_good_one(tmp_path: Path, caplog) -> None:
    store = CheckpointStore(tmp_path / "checkpoints", enabled=True)
    store.save(_payload(1))
    store.save(_payload(2))
    store.last.write_bytes(store.last.read_bytes()[:100])

    resumed = CheckpointStore(tmp_path / "checkpoints", enabled=True)  # a new process, as on resume
    with caplog.at_level(logging.WARNING):
        path, payload = resumed.find()
    assert path == resumed.prev and payload["progress"]["step"] == 1
    assert "last.pt is damaged" in caplog.text
    resumed.save(_payload(3))
    assert checkpoint.load(resumed.last)["progress"]["step"] == 3
    assert checkpoint.load(resumed.prev)["progress"]["step"] == 1  # the good one was kept


def test_all_damaged_is_an_error_naming_the_files(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path, enabled=True)
    store.last.write_bytes(b"junk")
    store.prev.write_bytes(b"more junk")
    with pytest.raises(RunError, match=r"no usable checkpoint .*last\.pt .*last\.prev\.pt"):
        store.find()


def test_a_write_that_does_not_verify_leaves_the_old_file(tmp_path: Path, monkeypatch) -> None:
    store = CheckpointStore(tmp_path, enabled=True)
    store.save(_payload(1))

    def broken_save(obj, f) -> None:
        f.write(b"PK\x03\x04 half a zip")  # what a full disk or a failing device can leave behind

    monkeypatch.setattr(checkpoint.torch, "save", broken_save)
    with pytest.raises(CheckpointError, match="does not verify"):
        store.save(_payload(2))
    assert checkpoint.load(store.last)["progress"]["step"] == 1
    assert not list(tmp_path.glob(".*.tmp"))


def test_a_kill_in_the_middle_of_a_save_leaves_the_previous_checkpoint(tmp_path: Path) -> None:
    """SIGKILL while the new file is being written: last.pt is untouched and the leftover is cleaned up."""
    script = textwrap.dedent(
        f"""
        import os, time, torch
        from imgtrain import checkpoint
        from test_checkpoint import _payload
        store = checkpoint.CheckpointStore(checkpoint.Path({str(tmp_path)!r}), enabled=True)
        store.save(_payload(1))
        os.fsync = lambda fd: time.sleep(600)  # hold the second save between its write and its rename
        store.save(_payload(2, size=2_000_000))
        """
    )
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parent)}
    proc = subprocess.Popen([sys.executable, "-c", script], env=env)
    deadline = time.monotonic() + 60
    while not list(tmp_path.glob(".last.pt.*.tmp")):
        assert proc.poll() is None and time.monotonic() < deadline, "the second save never started"
        time.sleep(0.05)
    time.sleep(0.2)
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
    store = CheckpointStore(tmp_path, enabled=True)  # the next run
    assert checkpoint.load(store.last)["progress"]["step"] == 1
    assert not list(tmp_path.glob(".*.tmp"))


def test_generator_states_round_trip() -> None:
    state = checkpoint.capture_rng()
    expected = (random.random(), np.random.rand(), torch.rand(3), np.random.randn())
    random.random(), np.random.rand(), torch.rand(8)
    checkpoint.restore_rng(state)
    again = (random.random(), np.random.rand(), torch.rand(3), np.random.randn())
    assert expected[:2] == again[:2] and torch.equal(expected[2], again[2]) and expected[3] == again[3]


def test_saved_generator_states_load_with_weights_only(tmp_path: Path) -> None:
    path = tmp_path / "rng.pt"
    checkpoint.write_verified({**_payload(1), "rng": checkpoint.capture_rng()}, path)
    assert checkpoint.load(path)["rng"]["torch"].dtype == torch.uint8
    assert os.stat(path).st_size > 0


def test_checkpoints_are_read_into_host_memory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Resume on a GPU crashed when load mapped the RNG states to the GPU: every load maps to the CPU now."""
    store = CheckpointStore(tmp_path / "checkpoints", enabled=True)
    store.save({**_payload(1), "rng": checkpoint.capture_rng()})
    seen = []
    real_load = torch.load
    monkeypatch.setattr(torch, "load", lambda *a, **kw: seen.append(kw.get("map_location")) or real_load(*a, **kw))
    path, payload = checkpoint.locate("auto", store)
    checkpoint.restore_rng(payload["rng"])
    assert path == store.last and seen == ["cpu"]
