"""Files written into a run directory others may write to (issue 30): temporary names nobody can plant a link
at, best.pt's rename made durable, and the leftovers of a killed write cleared without touching anything else."""

from __future__ import annotations

import json
import os
import secrets
from pathlib import Path

import pytest
from test_checkpoint import _payload

from imgtrain.resilience import checkpoint
from imgtrain.resilience.atomic import write_json
from imgtrain.resilience.checkpoint import CheckpointStore


@pytest.fixture
def planted(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """Links to a victim file planted where a run in a directory others can write might put its temporary
    files: the name with this process's pid (published in the run directory's lock) and the next random name
    the run draws (as if guessed). Yields plant(directory, name) and the victim."""
    victim = tmp_path / "victim.txt"
    victim.write_text("precious\n")
    guesses: list[str] = []
    real_token_hex = secrets.token_hex
    monkeypatch.setattr(secrets, "token_hex", lambda n=None: guesses.pop() if guesses else real_token_hex(n))

    def plant(directory: Path, name: str) -> list[Path]:
        directory.mkdir(parents=True, exist_ok=True)
        guesses.append("guessed")
        links = [directory / f".{name}.{os.getpid()}.tmp", directory / f".{name}.guessed.tmp"]
        for link in links:
            link.symlink_to(victim)
        return links

    return plant, victim


def test_a_link_planted_at_a_temporary_name_is_never_written_through(tmp_path: Path, planted) -> None:
    plant, victim = planted
    store = CheckpointStore(tmp_path / "run" / "checkpoints", enabled=True)  # before the plant, which it clears
    links = plant(tmp_path / "run", "metrics.json")
    write_json(tmp_path / "run" / "metrics.json", {"loss": 1.0})
    links += plant(store.directory, "last.pt")
    store.save(_payload(1))
    assert victim.read_bytes() == b"precious\n"
    assert json.loads((tmp_path / "run" / "metrics.json").read_text()) == {"loss": 1.0}
    assert checkpoint.load(store.last)["progress"]["step"] == 1
    assert not (tmp_path / "run" / "metrics.json").is_symlink() and not store.last.is_symlink()
    assert all(link.is_symlink() for link in links)  # not ours: left where they were


def test_mark_best_never_writes_through_a_planted_link(tmp_path: Path, planted) -> None:
    plant, victim = planted
    store = CheckpointStore(tmp_path / "checkpoints", enabled=True)
    store.save(_payload(1))
    plant(store.directory, "best.pt")
    store.mark_best()
    assert victim.read_bytes() == b"precious\n"
    assert not store.best.is_symlink() and checkpoint.load(store.best)["progress"]["step"] == 1


def test_mark_best_makes_its_rename_durable(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    store = CheckpointStore(tmp_path / "checkpoints", enabled=True)
    store.save(_payload(1))
    synced = []
    monkeypatch.setattr(checkpoint.files, "fsync_dir", lambda d: synced.append((d, store.best.exists())), raising=False)
    store.mark_best()
    assert synced == [(store.directory, True)]  # the directory, once best.pt is in it


def test_mark_best_copies_where_there_are_no_hard_links(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    store = CheckpointStore(tmp_path / "checkpoints", enabled=True)
    store.save(_payload(1))

    def no_links(*args, **kwargs):
        raise PermissionError(1, "Operation not permitted")

    monkeypatch.setattr(os, "link", no_links)
    store.mark_best()
    assert checkpoint.load(store.best)["progress"]["step"] == 1 and store.best.stat().st_nlink == 1
    assert not list(store.directory.glob(".*.tmp"))


def test_leftover_temporaries_are_cleared_and_nothing_else(tmp_path: Path) -> None:
    """A new store clears what a killed write left (random names now), a planted link without its target,
    and passes over a directory of that name instead of ending the run with a traceback."""
    directory = tmp_path / "checkpoints"
    directory.mkdir()
    (directory / ".last.pt.0123456789abcdef.tmp").write_bytes(b"half")
    victim = tmp_path / "victim.txt"
    victim.write_text("precious\n")
    (directory / ".best.pt.fedcba9876543210.tmp").symlink_to(victim)
    (directory / ".odd.tmp").mkdir()
    CheckpointStore(directory, enabled=True)
    assert [p.name for p in directory.iterdir()] == [".odd.tmp"] and victim.read_bytes() == b"precious\n"
