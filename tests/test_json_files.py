"""JSON the template reads back: nested 100,000 deep or otherwise malformed, each file is one
plain line naming it and what is wrong, never a RecursionError's traceback. The run directory's lock is in
test_rundir_races.py (`MALFORMED`)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from helpers import FAST, compose_cfg
from shardhelpers import failure, pack, shards_args

from imgtrain.common.atomic import BadJSON, read_json
from imgtrain.common.errors import RunError
from imgtrain.train.run import run

DEEP = "[" * 100_000  # Python's parser recurses once per level: a RecursionError, not a JSONDecodeError
# The converter's file names, as plain text: its modules import the shards extra, which the GPU box lacks (the
# `shards` fixture skips there).
MANIFEST, PARTIAL, INDEX = "imgtrain-shards.json", ".imgtrain-shards.partial.json", "index.json"


@pytest.mark.parametrize(
    ("text", "why"),
    [
        (DEEP, "nested too deeply to parse"),
        ('{"a": ', "not valid JSON: Expecting value: line 1 column 7 (char 6)"),
        (b"\xff{", "not valid JSON: 'utf-8' codec can't decode byte 0xff in position 0"),
        ("1" * 5000, "not valid JSON: Exceeds the limit (4300 digits) for integer string conversion"),
    ],
    ids=["deep", "cut short", "not utf-8", "long integer"],
)
def test_read_json_says_what_is_wrong_in_one_line(text: str | bytes, why: str, tmp_path: Path) -> None:
    path = tmp_path / "state.json"
    path.write_bytes(text if isinstance(text, bytes) else text.encode())
    for source, what in ((path, str(path)), (text, "the state")):
        with pytest.raises(BadJSON) as caught:
            read_json(source, what)
        assert str(caught.value).startswith(f"{what} cannot be read ({why}"), caught.value
        assert caught.value.why.startswith(why) and "\n" not in str(caught.value)
    assert read_json('{"a": [1]}', "x") == {"a": [1]}


def test_a_partial_file_nested_too_deeply_is_one_line(shards: Path, source: Path, tmp_path: Path, capsys) -> None:
    """`imgtrain-shards` resuming into a destination whose partial file is nested 100,000 deep (31 lines before)."""
    dst = tmp_path / "dst"
    shutil.copytree(shards, dst)
    (dst / MANIFEST).unlink()
    (dst / PARTIAL).write_text(DEEP)
    assert pack(source, dst) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"error: {dst / PARTIAL} cannot be read (nested too deeply to parse)"), err
    assert "\n" not in err and "Recursion" not in err


def test_a_manifest_or_index_nested_too_deeply_stops_the_run_in_one_line(shards: Path, tmp_path: Path) -> None:
    root = tmp_path / "shards"
    shutil.copytree(shards, root)
    manifest = (root / MANIFEST).read_text()
    (root / MANIFEST).write_text(DEEP)
    error = failure(*shards_args(root), run_dir=tmp_path / "run")
    assert str(error).startswith(f"{root / MANIFEST} is not a manifest this imgtrain can read (nested too deeply")
    assert "Recursion" not in str(error)

    recorded = json.loads(manifest)  # the index nested too deeply, its size recorded to match
    (root / "val" / INDEX).write_text(DEEP)
    recorded["splits"]["val"]["files"][INDEX] = len(DEEP)
    (root / MANIFEST).write_text(json.dumps(recorded))
    error = failure(*shards_args(root), run_dir=tmp_path / "run2")
    assert str(error).startswith(f"{root / 'val' / INDEX} cannot be read as LitData's index (nested too deeply")


@pytest.mark.slow  # slow: the fast suite's budget (make test <= 120 s on 2 cores); CI runs it in make test-slow
@pytest.mark.parametrize("text", [DEEP, "[1, 2]"], ids=["deep", "not a mapping"])
def test_a_finished_runs_damaged_summary_is_one_line(text: str, tmp_path: Path, data_dir: Path) -> None:
    """Run again in a finished run's directory, the summary it returns is read from metrics.json."""
    run(compose_cfg(*FAST, output_dir=str(tmp_path)))
    (tmp_path / "metrics.json").write_text(text)
    with pytest.raises(RunError) as caught:
        run(compose_cfg(*FAST, output_dir=str(tmp_path)))
    message = str(caught.value)
    assert message.startswith(f"this run already finished (step 8), but {tmp_path / 'metrics.json'} cannot be read")
    assert "\n" not in message and "hydra.run.dir" in message
