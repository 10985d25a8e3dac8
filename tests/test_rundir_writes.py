"""Files written into a run directory others may write to (issue 30): temporary names nobody can plant a link
at, best.pt's rename made durable, and the leftovers of a killed write cleared without touching anything else."""

from __future__ import annotations

import json
import os
import pwd
import secrets
from pathlib import Path

import pytest
from helpers import FAST, compose_cfg, run_train
from test_checkpoint import _payload

from imgtrain.common.atomic import write_json
from imgtrain.common.errors import ConfigError
from imgtrain.common.links import refuse_foreign_links
from imgtrain.resilience import checkpoint
from imgtrain.resilience.checkpoint import CheckpointStore
from imgtrain.train.run import run


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


# ----------------------------------------------------------------- links another user planted at the names a run writes
def _nameless_uid() -> int:
    """A user other than the one running the tests, with no name here: the line then says "uid N"."""
    uid = 4242
    while uid == os.geteuid() or uid in {entry.pw_uid for entry in pwd.getpwall()}:
        uid += 1
    return uid


OTHER_UID = _nameless_uid()


def _foreign_link(link: Path, target: Path) -> Path:
    """A symbolic link at `link` to `target`, owned by another user (as one they planted would be): root may
    lchown a link to anyone; elsewhere the test skips."""
    link.parent.mkdir(parents=True, exist_ok=True)
    link.symlink_to(target)
    try:
        os.lchown(link, OTHER_UID, OTHER_UID)
    except PermissionError:
        pytest.skip("giving a link to another user needs root (os.lchown)")
    assert link.lstat().st_uid == OTHER_UID
    return link


NAMES = (".hydra/config.yaml", "checkpoints/last.pt", "tb/events")  # as a run would ask
PLANTS = {  # where another user's link is planted -> the path the one line names
    "the run directory": ("run", "run"),
    "a directory on the way": ("run/.hydra", "run/.hydra"),
    "a file": ("run/tb/events", "run/tb/events"),
    "a file behind one's own link": ("mine/last.pt", "run/checkpoints/last.pt"),
}


@pytest.mark.parametrize("case", PLANTS)
def test_another_users_link_is_refused_in_one_line_and_ones_own_are_followed(case: str, tmp_path: Path) -> None:
    run_dir, victim = tmp_path / "run", tmp_path / "victim"
    for folder in (victim, tmp_path / "mine", run_dir / "tb"):
        folder.mkdir(parents=True)
    (run_dir / "checkpoints").symlink_to(tmp_path / "mine")  # this user's own: followed, what is behind it checked
    refuse_foreign_links(run_dir, *NAMES)  # nothing planted: nothing to say (names not there yet included)
    planted, named = (tmp_path / name for name in PLANTS[case])
    if planted == run_dir:
        run_dir.rename(tmp_path / "held")
    _foreign_link(planted, victim)
    with pytest.raises(ConfigError) as caught:
        refuse_foreign_links(run_dir, *NAMES)
    message = str(caught.value)
    assert message.startswith(f"{named} is a symbolic link owned by uid {OTHER_UID}"), message
    assert "hydra.run.dir" in message and "\n" not in message


def test_a_link_of_ones_own_that_leads_to_another_users_link_is_refused(tmp_path: Path) -> None:
    """tb/ this user's link to a shared folder's name, where another user planted a link to a victim folder."""
    run_dir, victim, theirs = tmp_path / "run", tmp_path / "victim", tmp_path / "shared-tb"
    run_dir.mkdir()
    victim.mkdir()
    (run_dir / "tb").symlink_to(theirs)  # this user's own link, followed
    _foreign_link(theirs, victim)
    with pytest.raises(ConfigError) as caught:
        refuse_foreign_links(run_dir, *NAMES)
    message = str(caught.value)
    assert message.startswith(f"{theirs} (behind {run_dir / 'tb'}, a link of yours) is a symbolic link owned by uid")
    assert "\n" not in message


@pytest.mark.parametrize("name", ["checkpoints", "tb", "profile", "."])
def test_a_run_never_writes_through_another_users_link(name: str, tmp_path: Path, data_dir: Path) -> None:
    """checkpoints/, tb/ and profile/ (or the run directory itself) a link another user planted: refused before
    anything is written there, in one line naming the link and its owner."""
    run_dir, victim = tmp_path / "run", tmp_path / "victim"
    victim.mkdir()
    link = _foreign_link(run_dir if name == "." else run_dir / name, victim)
    overrides = [*FAST, "metrics.profile=true", "metrics.profile_steps=1"]
    with pytest.raises(ConfigError) as caught:
        run(compose_cfg(*overrides, output_dir=str(run_dir)))
    assert str(caught.value).startswith(f"{link} is a symbolic link owned by uid {OTHER_UID}"), caught.value
    assert list(victim.iterdir()) == []


def test_the_runs_own_links_keep_working(tmp_path: Path, data_dir: Path) -> None:
    """The run directory, checkpoints/ and tb/ moved to a bigger disk by the run's own user."""
    bigger = tmp_path / "bigger"
    for name in ("run", "checkpoints", "tb"):
        (bigger / name).mkdir(parents=True)
    (tmp_path / "run").symlink_to(bigger / "run")
    for name in ("checkpoints", "tb"):
        (bigger / "run" / name).symlink_to(bigger / name)
    run(compose_cfg(*FAST, output_dir=str(tmp_path / "run")))
    assert (bigger / "checkpoints" / "last.pt").is_file() and list((bigger / "tb").glob("events.*"))
    assert (bigger / "run" / "metrics.json").is_file()


def test_metrics_and_failed_json_replace_a_planted_link_never_write_through(tmp_path: Path) -> None:
    victim = tmp_path / "victim.json"
    victim.write_text("precious\n")
    for name in ("metrics.json", "failed.json"):
        link = _foreign_link(tmp_path / "run" / name, victim)
        write_json(link, {"error": "x"})
        assert not link.is_symlink() and json.loads(link.read_text()) == {"error": "x"}
    assert victim.read_text() == "precious\n"


HYDRA_PLANTS = {  # what Hydra writes before any task code runs: .hydra/ and the log file, or the directory itself
    ".hydra": lambda run_dir, victim: _foreign_link(run_dir / ".hydra", victim),
    "train.log": lambda run_dir, victim: _foreign_link(run_dir / "train.log", victim / "train.log"),
    "run dir": lambda run_dir, victim: _foreign_link(run_dir, victim),
    "a job of a sweep": lambda run_dir, victim: _foreign_link(run_dir / "0" / ".hydra", victim),
}


# Each case is a train.py process (about 5 s): .hydra in make test, the others in make test-slow
HYDRA_CASES = [case if case == ".hydra" else pytest.param(case, marks=pytest.mark.slow) for case in HYDRA_PLANTS]


@pytest.mark.slow  # slow: the fast suite's budget (make test <= 120 s on 2 cores); CI runs it in make test-slow
@pytest.mark.parametrize("case", HYDRA_CASES)
def test_hydra_never_writes_through_another_users_link(case: str, tmp_path: Path, data_dir: Path) -> None:
    """The callback that runs first refuses before Hydra writes .hydra/config.yaml or the log: exit status 2,
    one line, the link's target untouched."""
    run_dir, victim = tmp_path / "run", tmp_path / "victim"
    victim.mkdir()
    link = HYDRA_PLANTS[case](run_dir, victim)
    sweep = ["-m", f"hydra.sweep.dir={run_dir}", "train.max_steps=1,2"] if case == "a job of a sweep" else []
    result = run_train([*sweep[:1], *FAST, *sweep[1:]], run_dir, data_dir)
    errors = [line for line in result.stderr.splitlines() if line.strip()]
    assert result.returncode == 2 and len(errors) == 1, result.stderr
    assert errors[0].startswith(f"error: {link} is a symbolic link owned by uid {OTHER_UID}"), errors[0]
    assert list(victim.iterdir()) == []
