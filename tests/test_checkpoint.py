"""Checkpoint files: atomic writes, damage detection, the verified fallback, and generator states."""

from __future__ import annotations

import inspect
import logging
import os
import random
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import FAST, compose_cfg

from imgtrain.common.errors import RunError
from imgtrain.config.faults import NonFinite
from imgtrain.config.validate import validate
from imgtrain.host.dist import DistInfo
from imgtrain.resilience import checkpoint
from imgtrain.resilience.agreement import WindowReport, merge
from imgtrain.resilience.checkpoint import Checkpointer, CheckpointError, CheckpointStore
from imgtrain.resilience.faults import Faults
from imgtrain.train.step import build_step


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

    monkeypatch.setattr(torch, "save", broken_save)
    with pytest.raises(CheckpointError, match="does not verify"):
        store.save(_payload(2))
    assert checkpoint.load(store.last)["progress"]["step"] == 1
    assert not list(tmp_path.glob(".*.tmp"))


def test_a_kill_in_the_middle_of_a_save_leaves_the_previous_checkpoint(tmp_path: Path) -> None:
    """SIGKILL while the new file is being written: last.pt is untouched and the leftover is cleaned up."""
    script = textwrap.dedent(
        f"""
        import os, pathlib, time, torch
        from imgtrain.resilience import checkpoint
        store = checkpoint.CheckpointStore(pathlib.Path({str(tmp_path)!r}), enabled=True)
        store.save(_payload(1))
        pathlib.Path({str(tmp_path / "first.done")!r}).touch()  # the first save is whole: watch for the second
        os.fsync = lambda fd: time.sleep(600)  # hold the second save between its write and its rename
        store.save(_payload(2, size=2_000_000))
        """
    )
    # _payload's own source, not an import of this module: that imports Hydra too (1.8 s more on 2 busy cores)
    script = "from __future__ import annotations\n" + inspect.getsource(_payload) + script
    proc = subprocess.Popen([sys.executable, "-c", script])
    deadline = time.monotonic() + 60
    # the second save's temporary file, not the first save's (an fsync on a busy disk can hold that one for a
    # while: killed then, there would be no last.pt to keep)
    while not ((tmp_path / "first.done").exists() and list(tmp_path.glob(".last.pt.*.tmp"))):
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


def _checkpointer(tmp_path: Path) -> Checkpointer:
    """A Checkpointer for a small model with AdamW, one training step in (so the optimizer has state)."""
    settings = validate(compose_cfg(*FAST))
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.BatchNorm2d(4), torch.nn.Flatten())
    step = build_step(settings, model, torch.device("cpu"), "fp32", (8, 16))
    model(torch.randn(2, 3, 5, 5)).square().mean().backward()
    step.optimizer.step()
    checkpointer = Checkpointer(settings, tmp_path, DistInfo(), Faults(NonFinite.stop, None, "cpu"))
    checkpointer.attach(model, step, total_steps=16)
    return checkpointer


def _held_store(monkeypatch: pytest.MonkeyPatch) -> threading.Event:
    """Hold every background write until the returned event is set."""
    release, real_save = threading.Event(), CheckpointStore.save

    def held(self, payload, best=False):
        assert release.wait(30)
        return real_save(self, payload, best)

    monkeypatch.setattr(CheckpointStore, "save", held)
    return release


def test_a_background_save_holds_the_state_of_the_step_it_was_asked_at(tmp_path: Path, monkeypatch) -> None:
    """Training changes the weights and optimizer state while the write is in flight; the file still holds
    the state at the save, the same as a synchronous torch.save at that moment."""
    checkpointer = _checkpointer(tmp_path)
    checkpointer.progress.step = 5
    checkpoint.write_verified(checkpointer._payload(), tmp_path / "sync.pt")  # what a synchronous save writes
    release = _held_store(monkeypatch)
    checkpointer.save()
    assert checkpointer.writer.busy  # returned before writing
    with torch.no_grad():  # the next steps: in-place updates, as optimizer.step() does
        for tensor in [
            *checkpointer.model.state_dict().values(),
            *checkpointer.step_state.optimizer.state[next(iter(checkpointer.step_state.optimizer.state))].values(),
        ]:
            tensor.add_(1)
    checkpointer.progress.step = 6
    release.set()
    checkpointer.writer.close()
    written, sync = checkpoint.load(checkpointer.store.last), checkpoint.load(tmp_path / "sync.pt")
    assert written["progress"]["step"] == 5
    for key in ("model", "optimizer"):
        assert _same(written[key], sync[key]), key
    assert written["optimizer_class"] == sync["optimizer_class"] and written["rng"]["torch"].equal(sync["rng"]["torch"])


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    return a == b


def test_one_write_in_flight_a_periodic_save_is_skipped_and_best_waits(tmp_path: Path, monkeypatch, caplog) -> None:
    checkpointer = _checkpointer(tmp_path)
    release = _held_store(monkeypatch)
    caplog.set_level(logging.INFO)
    checkpointer.progress.step = 3
    checkpointer.save()
    checkpointer.progress.step = 6
    checkpointer.save()  # periodic: skipped, the run goes on
    assert "checkpoint of step 6 skipped: the one of step 3 is still being written" in caplog.text
    threading.Timer(0.2, release.set).start()
    checkpointer.progress.step = 8
    checkpointer.save(best=True)  # validation improved: must be written, so it waits
    assert "for the checkpoint of step 3 before saving step 8" in caplog.text
    checkpointer.writer.close()
    assert checkpoint.load(checkpointer.store.best)["progress"]["step"] == 8
    assert checkpoint.load(checkpointer.store.prev)["progress"]["step"] == 3


def test_the_clock_is_agreed_at_a_window_and_the_epoch_end_follows_it(tmp_path: Path, monkeypatch) -> None:
    checkpointer = _checkpointer(tmp_path)
    saves = []
    monkeypatch.setattr(checkpointer, "save", lambda best=False, wait=False: saves.append((best, wait)))
    checkpointer.agree(merge([WindowReport(**checkpointer.report())]))
    checkpointer.step()
    checkpointer.end_epoch(improved=False, last=False)
    assert saves == [] and checkpointer.every_s == 600  # the 10-minute default has not run out
    checkpointer.last_save -= 601
    assert checkpointer.report()["checkpoint_due"]
    checkpointer.agree(merge([WindowReport(**checkpointer.report()), WindowReport()]))  # rank 0's clock decides
    checkpointer.end_epoch(improved=False, last=False)
    checkpointer.end_epoch(improved=True, last=False)  # best.pt, whatever the clock
    assert saves == [(False, False), (True, False)]


def test_steps_between_saves_touch_no_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`Checkpointer.step` runs after every training step: no stat of last.pt there (microseconds on a local disk,
    up to a millisecond on NFS or Lustre, next to a 12 ms step). The sentence naming the last checkpoint is built
    only when a message uses it."""
    checkpointer = _checkpointer(tmp_path)
    stats: list[str] = []
    real_stat = os.stat
    monkeypatch.setattr(os, "stat", lambda path, *a, **k: stats.append(str(path)) or real_stat(path, *a, **k))
    monkeypatch.setattr(Checkpointer, "last_checkpoint", lambda self: stats.append("last_checkpoint") or "")
    for _ in range(15):  # no interval, no clock due: nothing to save
        checkpointer.progress.advance(2)
        checkpointer.step()
    assert stats == []
