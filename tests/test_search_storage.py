"""hparams_search's storage URL (hydra.sweeper.storage): a database Optuna cannot open, or one that never answers,
ends the search in one line; a password in the URL is never printed, logged or written into a job's folder."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from bounded import within
from helpers import CONF_DIR, FAST, ROOT
from hydra import compose, initialize_config_dir
from test_search import _search

import hydra_plugins.imgtrain_optuna.optuna_search as optuna_search
from hydra_plugins.imgtrain_optuna.optuna_search import refuse_written_password
from imgtrain.common.errors import ConfigError

pytest.importorskip("optuna", reason="hparams_search needs the search extra: pip install -e '.[search]'")

SECRET = "s3cretpass"


def _one_line_without_the_secret(error: BaseException, starts: str) -> str:
    line = str(error)
    assert "\n" not in line and SECRET not in line and line.startswith(starts), line
    return line


@pytest.mark.parametrize(
    "storage",
    [
        "nosuch://user:s3cretpass@host/db",
        "sqlite:///file:/no/such/folder/search.db?uri=true&password=s3cretpass",
        "not a url",
    ],
)
def test_a_storage_optuna_cannot_open_is_one_line(tmp_path: Path, storage: str) -> None:
    """optuna.create_study's error was a traceback of 52 to 141 lines, quoting the URL."""
    sweeper, launcher = _search(tmp_path, float, storage=storage)
    with pytest.raises(ConfigError) as caught:
        sweeper.sweep([])
    line = _one_line_without_the_secret(caught.value, "hydra.sweeper.storage=")
    assert "Optuna cannot open the study there (" in line and not launcher.batches


@pytest.fixture
def silent_database() -> Iterator[int]:
    """A port that accepts connections and never answers (a database server that hangs)."""
    server, held = socket.socket(), []
    server.bind(("127.0.0.1", 0))
    server.listen(8)
    server.settimeout(0.2)

    def accept() -> None:
        while server.fileno() != -1:
            try:
                held.append(server.accept()[0])
            except OSError:  # the timeout, to look at fileno again; or the socket closed
                continue

    threading.Thread(target=accept, daemon=True).start()
    yield server.getsockname()[1]
    server.close()
    for connection in held:  # the driver's read returns, and the thread left waiting on it ends
        connection.close()


def test_a_database_that_never_answers_ends_the_search_in_one_line(
    tmp_path: Path, silent_database: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """pg8000, like psycopg2, waits for a server's answer without a timeout of its own: the search waited forever."""
    pytest.importorskip("pg8000", reason="a PostgreSQL driver: pip install -e '.[dev]'")
    monkeypatch.setattr(optuna_search, "STORAGE_TIMEOUT_S", 1.0, raising=False)
    sweeper, _ = _search(tmp_path, float, storage=f"postgresql+pg8000://user:{SECRET}@127.0.0.1:{silent_database}/db")
    with within(20, "opening the study"), pytest.raises(ConfigError) as caught:
        sweeper.sweep([])
    line = _one_line_without_the_secret(caught.value, "hydra.sweeper.storage=postgresql+pg8000://127.0.0.1:")
    assert "(no answer within 1 s)" in line


def _search_config(*overrides: str):
    with initialize_config_dir(version_base="1.3", config_dir=str(CONF_DIR)):
        return compose("config", overrides=["hparams_search=loader", *overrides], return_hydra_config=True)


def test_a_password_written_in_the_config_is_refused_and_one_from_the_environment_is_not(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Hydra writes the config unresolved into each job's .hydra/hydra.yaml: a password written in the URL lands
    there (twice, with the command line's overrides), one behind ${oc.env:...} does not."""
    url = f"postgresql+pg8000://user:{SECRET}@db.example/search"
    config = _search_config(f"hydra.sweeper.storage='{url}'")
    with pytest.raises(ConfigError) as caught:
        refuse_written_password(config.hydra.sweeper.storage, config)
    line = _one_line_without_the_secret(caught.value, "hydra.sweeper.storage=postgresql+pg8000://db.example/search ")
    assert "holds a password, which every job's .hydra/hydra.yaml would keep" in line
    assert "hydra.sweeper.storage='${oc.env:OPTUNA_STORAGE}'" in line
    monkeypatch.setenv("OPTUNA_STORAGE", url)
    monkeypatch.setenv("DB_PASSWORD", SECRET)
    for storage in ("${oc.env:OPTUNA_STORAGE}", "'postgresql+pg8000://user:${oc.env:DB_PASSWORD}@db.example/search'"):
        config = _search_config(f"hydra.sweeper.storage={storage}")
        assert config.hydra.sweeper.storage == url  # resolved for the sweeper, not where Hydra writes it
        refuse_written_password(config.hydra.sweeper.storage, config)


def _files_holding(folder: Path, text: str) -> list[str]:
    return [str(path) for path in folder.rglob("*") if path.is_file() and text.encode() in path.read_bytes()]


@pytest.mark.slow  # two real searches through train.py: about 20 s
def test_a_storage_password_reaches_no_job_file_and_no_output(tmp_path: Path, data_dir: Path) -> None:
    """A working storage URL with a password (SQLite ignores the `password` query parameter of its URI form): written
    in the command line, refused before anything is written; from the environment, the search runs and no file of
    the sweep, nor its output, holds the password. At 0216dfa each job's .hydra/hydra.yaml held it twice."""
    url = f"sqlite:///file:{tmp_path / 'search.db'}?mode=rwc&uri=true&password={SECRET}"
    args = [sys.executable, str(ROOT / "train.py"), "-m", "hparams_search=loader", "hydra.sweeper.n_trials=1"]
    args += [*FAST, "train.max_steps=8", "metrics.log_every_n_steps=1", "data.num_workers=0"]
    args += ["data.pin_memory=false", "data.prefetch_factor=2"]
    env = {**os.environ, "IMGTRAIN_DATA_DIR": str(data_dir), "OPTUNA_STORAGE": url}
    said = {}
    for storage, sweep, code in (
        (f"'{url}'", tmp_path / "written", 2),
        ("${oc.env:OPTUNA_STORAGE}", tmp_path / "env", 0),
    ):
        command = [*args, f"hydra.sweeper.storage={storage}", f"hydra.sweep.dir={sweep}"]
        result = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
        assert result.returncode == code, result.stderr[-3000:]
        assert SECRET not in result.stdout + result.stderr
        assert not sweep.exists() or not _files_holding(sweep, SECRET)
        said[sweep.name] = result.stderr.strip().splitlines()[-1]
    assert (
        said["written"].startswith("error: hydra.sweeper.storage=sqlite:///file:")
        and "holds a password" in said["written"]
    )
    assert "${oc.env:OPTUNA_STORAGE}" in (tmp_path / "env" / "0" / ".hydra" / "hydra.yaml").read_text()
    assert (tmp_path / "env" / "optimization_results.yaml").exists()  # the search ran, on that storage
