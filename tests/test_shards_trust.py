"""What others can put in front of dataset=shards (issue 30): shards, manifests and indexes written by someone else,
locally and on a real S3-compatible server (moto, s3server.py), a conversion stopped from outside, credentials in
the endpoint URL, malformed files. None of it runs code, reaches outside its folder or shows a secret; each ends
in one line."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from helpers import ROOT
from shardhelpers import failure, pack, shards_args

pytest.importorskip("litdata", reason="dataset=shards needs the shards extra: pip install -e '.[shards]'")

import litdata  # noqa: E402

from imgtrain.data.shards import dataset as shards_dataset  # noqa: E402
from imgtrain.data.shards import engine, staging  # noqa: E402
from imgtrain.data.shards.dataset import ShardError, ShardSplit, build_shards  # noqa: E402
from imgtrain.data.shards.manifest import MANIFEST, PARTIAL  # noqa: E402
from imgtrain.data.shards.store import Location  # noqa: E402

# The whole file is slow: the fast suite's budget (make test <= 120 s on 2 cores); CI runs it in make test-slow
pytestmark = pytest.mark.slow

BUCKET = "trust"


class Planted:
    """A pickled object that runs a command when it is loaded (os.system through __reduce__)."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


class PlantedSamples:
    """LitData's `fn`: samples shaped like the converter's, whose image is a Planted object (LitData stores it with
    its pickle serializer and records "pickle" in the index)."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __call__(self, index: int) -> dict:
        return {"index": index, "label": 0, "path": f"ring/{index}.jpg", "image": Planted(self.marker)}


def planted(shards: Path, tmp_path: Path) -> tuple[Path, Path]:
    """A copy of `shards` whose train split is replaced by planted samples, the manifest updated to match (as anyone
    who can write the destination can do); returns (the copy, the file the planted command would create)."""
    root, marker = tmp_path / "planted", tmp_path / "planted-ran"
    shutil.copytree(shards, root)
    shutil.rmtree(root / "train")
    with engine.scratch_env(str(tmp_path / "scratch")):
        litdata.optimize(
            fn=PlantedSamples(str(marker)),
            inputs=list(range(32)),  # one batch of shards_args' 32: the run reaches the samples
            output_dir=str(root / "train"),
            chunk_bytes="1MB",
            num_workers=1,
            start_method="fork",  # as the converter: the worker needs no fresh interpreter
            verbose=False,
        )
    _record(root, "train", samples=32)
    return root, marker


def _record(root: Path, split: str, samples: int | None = None) -> None:
    """The manifest's record of `split` made to match its files again (names, sizes, sample count)."""
    manifest = json.loads((root / MANIFEST).read_text())
    record = manifest["splits"][split]
    record["files"] = {str(p.relative_to(root / split)): p.stat().st_size for p in (root / split).rglob("*.*")}
    record["samples"] = record["samples"] if samples is None else samples
    (root / MANIFEST).write_text(json.dumps(manifest))


def _split(root: str, split: str, samples: int, cache_dir: Path | None = None) -> ShardSplit:
    cache = {"dir": str(cache_dir) if cache_dir else None, "limit": None, "timeout_s": 5.0}
    return ShardSplit(Location.parse(root), split, None, gpu_decode=False, cache=cache, samples=samples)


def test_a_shard_whose_index_asks_for_pickle_never_runs_it(
    shards: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    root, marker = planted(shards, tmp_path)
    error = failure(*shards_args(root), run_dir=tmp_path / "run")
    assert "train/index.json: data_format is ['int', 'int', 'str', 'pickle']" in str(error), error
    assert not marker.exists()
    # Met after that check (the index changed in between, or the split opened without it): LitData may still not
    # use its pickle decoder, neither by random access nor in the loader's iteration.
    with pytest.raises(ValueError, match="asks for LitData's 'pickle' decoder"):
        _split(str(root), "train", 32)[0]
    with pytest.raises(ShardError, match="train: a shard cannot be read .*'pickle' decoder"):
        next(iter(_split(str(root), "train", 32)))
    monkeypatch.setattr(shards_dataset, "check_files", lambda *args: None)  # a run that meets it: one line too
    error = failure(*shards_args(root), run_dir=tmp_path / "unchecked")
    assert isinstance(error, ShardError) and "'pickle' decoder" in str(error)
    assert not marker.exists()


# ----------------------------------------------------------------------------- object storage (moto)
@pytest.fixture(scope="module")
def s3() -> Iterator:
    pytest.importorskip("moto", reason="the object-storage tests need moto (the dev extra)")
    from s3server import s3_server

    with s3_server() as server:
        server.client().create_bucket(Bucket=BUCKET)
        yield server


@pytest.fixture
def aws(s3, monkeypatch: pytest.MonkeyPatch):
    for key, value in s3.env().items():
        monkeypatch.setenv(key, value)
    return s3


def upload(server, root: Path, prefix: str, rename: dict[str, str] | None = None) -> str:
    """Every file under `root` as s3://trust/<prefix>/..., `rename` giving some another key; returns the URL."""
    client = server.client()
    for path in root.rglob("*"):
        if path.is_file():
            key = str(path.relative_to(root))
            client.put_object(Bucket=BUCKET, Key=f"{prefix}/{(rename or {}).get(key, key)}", Body=path.read_bytes())
    return f"s3://{BUCKET}/{prefix}"


def test_on_object_storage_a_shard_asking_for_pickle_never_runs_it(shards: Path, aws, tmp_path: Path) -> None:
    root, marker = planted(shards, tmp_path)
    url = upload(aws, root, "planted")
    cache = tmp_path / "cache"
    error = failure(*shards_args(url, f"dataset.cache_dir={cache}"), run_dir=tmp_path / "run")
    assert f"{url}/train/index.json: data_format is ['int', 'int', 'str', 'pickle']" in str(error), error
    with pytest.raises(ShardError, match="'pickle' decoder"):  # met after the check
        next(iter(_split(url, "train", 32, cache / "after")))
    assert not marker.exists()


def _escaping_chunk(root: Path) -> dict[str, str]:
    """The first train chunk renamed `../../escape-<name>` in the index and the manifest (the key on the store
    too): LitData would join it into its cache folder and write two levels above it."""
    index = json.loads((root / "train" / "index.json").read_text())
    name = index["chunks"][0]["filename"]
    index["chunks"][0]["filename"] = f"../../escape-{name}"
    (root / "train" / "index.json").write_text(json.dumps(index))
    _record(root, "train")
    manifest = json.loads((root / MANIFEST).read_text())
    files = manifest["splits"]["train"]["files"]
    files[f"../../escape-{name}"] = files.pop(name)
    (root / MANIFEST).write_text(json.dumps(manifest))
    return {f"train/{name}": f"train/../../escape-{name}"}


def _escaping_cache_folder(root: Path) -> dict[str, str]:
    """LitData names its cache folder after the index's `updated_at`: a path there moves the cache elsewhere."""
    index = json.loads((root / "train" / "index.json").read_text())
    index["updated_at"] = "../../../escape-folder"
    (root / "train" / "index.json").write_text(json.dumps(index))
    _record(root, "train")
    return {}


@pytest.mark.parametrize("damage", [_escaping_chunk, _escaping_cache_folder], ids=["chunk name", "updated_at"])
def test_on_object_storage_no_name_from_an_index_reaches_outside_its_folder(
    damage, shards: Path, aws, tmp_path: Path
) -> None:
    root = tmp_path / "copy"
    shutil.copytree(shards, root)
    url = upload(aws, root, damage.__name__, damage(root))
    cache = tmp_path / "cache"
    try:
        error = failure(*shards_args(url, f"dataset.cache_dir={cache}"), run_dir=tmp_path / "run")
    finally:  # what matters most, however the run ended: nothing was written outside the cache folder
        assert not [str(p) for p in tmp_path.rglob("*escape*") if not p.is_relative_to(root)]
    assert "escape" in str(error) and (" names the file " in str(error) or "updated_at is" in str(error)), error


# ----------------------------------------------------------------------------- credentials
SECRETS = {"AWS_ACCESS_KEY_ID": "AKIAFAKEKEYID4TEST", "AWS_SECRET_ACCESS_KEY": "fakeSecretAccessKey+4test"}
USER, PASSWORD = "alice-user", "hunter2-password"


def _secret_env(server, port: int | None = None) -> dict[str, str]:
    port = port or int(server.endpoint.rsplit(":", 1)[1])
    return server.env(AWS_ENDPOINT_URL=f"http://{USER}:{PASSWORD}@127.0.0.1:{port}", **SECRETS)


def _leaks(texts: dict[str, str]) -> list[str]:
    values = [USER, PASSWORD, *SECRETS.values()]
    return [f"{where}: {value}" for where, text in texts.items() for value in values if value in text]


def test_credentials_of_the_endpoint_never_reach_a_message(
    s3, source: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys
) -> None:
    from s3server import free_port

    for key, value in _secret_env(s3, free_port()).items():  # an endpoint that refuses connections
        monkeypatch.setenv(key, value)
    error = failure(*shards_args(f"s3://{BUCKET}/x", "dataset.timeout_s=1"), run_dir=tmp_path / "run")
    assert "could not connect to the endpoint at http://127.0.0.1:" in str(error), error
    assert pack(source, f"s3://{BUCKET}/x") == 1
    assert not _leaks({"run": str(error), "imgtrain-shards": capsys.readouterr().err})


def _files(*folders: Path) -> dict[str, str]:
    return {str(p): p.read_bytes().decode(errors="replace") for f in folders for p in f.rglob("*") if p.is_file()}


@pytest.mark.slow  # a conversion and two runs, real processes: about 40 s
def test_no_file_of_a_conversion_a_run_or_a_failed_run_holds_a_credential(
    s3, source: Path, tmp_path: Path, data_dir: Path
) -> None:
    from s3server import free_port

    env = {**os.environ, **_secret_env(s3), "IMGTRAIN_DATA_DIR": str(data_dir), "TMPDIR": str(tmp_path / "tmp")}
    (tmp_path / "tmp").mkdir()
    url, outputs = f"s3://{BUCKET}/secret", {}
    cmd = [sys.executable, "-m", "imgtrain.data.shards.command", str(source), url, "--workers", "2"]
    converted = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert converted.returncode == 0, converted.stderr[-2000:]
    train = [sys.executable, str(ROOT / "train.py"), *shards_args(url, f"dataset.cache_dir={tmp_path / 'cache'}")]
    trained = subprocess.run(
        [*train, f"hydra.run.dir={tmp_path / 'run'}"], env=env, capture_output=True, text=True, timeout=300, cwd=ROOT
    )
    assert trained.returncode == 0, trained.stderr[-2000:]
    refused = {**env, **_secret_env(s3, free_port())}
    failed = subprocess.run(
        [*train, f"hydra.run.dir={tmp_path / 'failed'}"], env=refused, capture_output=True, text=True, cwd=ROOT
    )
    assert failed.returncode == 1 and "could not connect to the endpoint" in failed.stderr, failed.stderr[-2000:]
    assert (tmp_path / "failed" / "failed.json").exists() and (tmp_path / "failed" / "train.log").exists()
    destination = tmp_path / "destination"  # every object the conversion wrote
    for item in s3.client().list_objects_v2(Bucket=BUCKET, Prefix="secret/")["Contents"]:
        path = destination / item["Key"]
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(s3.client().get_object(Bucket=BUCKET, Key=item["Key"])["Body"].read())
    for name, result in (("convert", converted), ("run", trained), ("failed run", failed)):
        outputs[name] = result.stdout + result.stderr
    files = _files(tmp_path / "run", tmp_path / "failed", tmp_path / "cache", destination, tmp_path / "tmp")
    assert len(files) > 10 and not _leaks({**outputs, **files})


# ----------------------------------------------------------------------------- malformed files
def _partial(dst: Path, text: str) -> None:
    (dst / MANIFEST).unlink()
    (dst / PARTIAL).write_text(text)


def _edit_manifest(root: Path, change) -> None:
    manifest = json.loads((root / MANIFEST).read_text())
    change(manifest)
    (root / MANIFEST).write_text(json.dumps(manifest))


CONVERTER_CASES = {
    "partial cut short": (lambda dst: _partial(dst, '{"fingerprint": '), f"{PARTIAL} cannot be read (not valid JSON"),
    "partial count a string": (
        lambda dst: _partial(dst, json.dumps({"fingerprint": "x", "done": {"val": {"samples": "1", "files": {}}}})),
        "cannot be read (the val split's sample count is '1', not a whole number",
    ),
    "partial name outside": (
        lambda dst: _partial(
            dst, json.dumps({"fingerprint": "x", "done": {"train": {"samples": 1, "files": {"../../x.bin": 1}}}})
        ),
        "names the file '../../x.bin'",
    ),
}


@pytest.mark.parametrize("case", CONVERTER_CASES)
def test_a_malformed_partial_file_is_one_line(case: str, shards: Path, source: Path, tmp_path: Path, capsys) -> None:
    damage, expected = CONVERTER_CASES[case]
    dst = tmp_path / "dst"
    shutil.copytree(shards, dst)
    damage(dst)
    assert pack(source, dst) == 2
    err = capsys.readouterr().err.strip()
    assert expected in err and err.count("\n") == 0 and err.startswith(f"error: {dst / PARTIAL}"), err


@pytest.mark.parametrize("dst", ["S3://trust/x", "s3:/trust/x", "gs://trust/x"])
def test_a_destination_that_is_almost_s3_is_refused_not_made_a_folder(
    dst: str, source: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys
) -> None:
    monkeypatch.chdir(tmp_path)
    assert pack(source, dst) == 2
    err = capsys.readouterr().err.strip()
    assert f"DST={dst} is neither a directory nor an S3 URL" in err and "s3://bucket/prefix" in err, err
    assert not list(tmp_path.iterdir())


def test_a_symlink_loop_in_the_source_is_one_line(source: Path, tmp_path: Path, capsys) -> None:
    src = tmp_path / "src"
    shutil.copytree(source, src)
    (src / "train" / "ring" / "back").symlink_to("..")  # ring/back/ring/back/...: each image listed again
    started = time.monotonic()
    assert pack(src, tmp_path / "out") == 2
    err = capsys.readouterr().err.strip()
    assert f"a symlink loop under {src}/train/ring: {src}/train/ring/back leads back to" in err, err
    assert time.monotonic() - started < 10 and not (tmp_path / "out" / "train").exists()


MANIFEST_CASES = {
    "no val split": (lambda m: m["splits"].pop("val"), "splits are ['train'], not ['train', 'val']"),
    "classes a string": (lambda m: m.update(classes="abc"), "classes is 'abc', not a list"),
    "count a string": (lambda m: m["splits"]["val"].update(samples="64"), "sample count is '64', not a whole"),
    "size a string": (lambda m: m["splits"]["val"]["files"].update({"index.json": "1"}), "index.json is '1'"),
    "name outside": (lambda m: m["splits"]["val"]["files"].update({"../x.bin": 1}), "names the file '../x.bin'"),
    "no fingerprint": (lambda m: m["source"].pop("fingerprint"), "source.fingerprint is None, not text"),
}


@pytest.mark.parametrize("case", MANIFEST_CASES)
def test_a_malformed_manifest_stops_the_run_in_one_line(case: str, shards: Path, tmp_path: Path) -> None:
    change, expected = MANIFEST_CASES[case]
    root = tmp_path / "shards"
    shutil.copytree(shards, root)
    _edit_manifest(root, change)
    error = failure(*shards_args(root), run_dir=tmp_path / "run")
    assert str(error).startswith(str(root / MANIFEST)) and expected in str(error), error


# ----------------------------------------------------------------- stops (real signals: test_shards_resume.py)
def test_a_second_conversion_into_the_same_destination_is_refused_while_one_runs(
    source: Path, tmp_path: Path, capsys
) -> None:
    dst = tmp_path / "out"
    with staging.staging(Location.parse(str(dst)).url):  # the first conversion's hold on its staging folder
        assert pack(source, dst) == 2
    assert "another imgtrain-shards is converting into it" in capsys.readouterr().err


# ----------------------------------------------------------------------------- issue 33
def test_a_shard_split_says_how_many_samples_it_stores(shards: Path, tmp_path: Path) -> None:
    """What the run can name when the batch is larger than the split: the stored count, not LitData's per-rank
    count after its drop of incomplete batches (0 here)."""
    half = [0.5, 0.5, 0.5]
    bundle = build_shards("shards", 32, half, half, False, str(shards), None, "cpu", str(tmp_path), None, 5.0)
    assert (bundle.train.samples, bundle.val.samples) == (256, 64)
    bundle.train.set_drop_last(True)
    assert bundle.train.get_len(1, 512) == 0 and bundle.train.get_len(2, 64) == 256
