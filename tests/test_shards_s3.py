"""dataset=shards from object storage, against a real S3-compatible server on 127.0.0.1 (moto in server mode, its
own process; s3server.py). Only the standard AWS variables are set. Each failure of the store ends the run in
one line naming the URL and the cause, within seconds, before any step, with the run directory untouched."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from helpers import compose_cfg, read_metrics
from shardhelpers import failure, pack, shards_args, stop_after_step_5

pytest.importorskip("litdata", reason="dataset=shards needs the shards extra: pip install -e '.[shards]'")
pytest.importorskip("moto", reason="the object-storage tests need moto (the dev extra)")

from s3server import S3Server, free_port, s3_server, silent_endpoint  # noqa: E402

from imgtrain.common.errors import ConfigError  # noqa: E402
from imgtrain.train.run import run  # noqa: E402

# The whole file is slow: the fast suite's budget (make test <= 120 s on 2 cores); CI runs it in make test-slow
pytestmark = pytest.mark.slow

ROOT = "s3://shards/shapes"


@pytest.fixture(scope="session")
def s3(source: Path) -> Iterator[S3Server]:
    """One server for the session, holding `source` converted into s3://shards/shapes by imgtrain-shards."""
    with s3_server() as server:
        with pytest.MonkeyPatch.context() as patch:  # the AWS variables for the conversion only
            for key, value in server.env().items():
                patch.setenv(key, value)
            server.client().create_bucket(Bucket="shards")
            assert pack(source, ROOT) == 0
        yield server


@pytest.fixture
def aws(s3: S3Server, monkeypatch: pytest.MonkeyPatch) -> S3Server:
    for key, value in s3.env().items():
        monkeypatch.setenv(key, value)
    return s3


def test_converted_into_object_storage_with_the_manifest_last(aws: S3Server) -> None:
    keys = [item["Key"] for item in aws.client().list_objects_v2(Bucket="shards", Prefix="shapes/")["Contents"]]
    assert "shapes/imgtrain-shards.json" in keys and "shapes/.imgtrain-shards.partial.json" not in keys
    assert any(key.startswith("shapes/train/chunk-") for key in keys) and "shapes/val/index.json" in keys


def test_training_from_object_storage_caches_each_split_under_cache_dir(aws: S3Server, tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    run(compose_cfg(*shards_args(ROOT, f"dataset.cache_dir={cache}"), output_dir=str(tmp_path / "run")))
    metrics = read_metrics(tmp_path / "run")
    assert metrics["steps"] == 8 and metrics["val_count"] == 64
    assert metrics["pipeline"]["stage_ms_per_image"]["read"] > 0
    assert list((cache / "shards" / "shapes" / "train").rglob("chunk-*.bin"))  # fetched once, kept on this node


@pytest.fixture(scope="session")
def s3_iam() -> Iterator[S3Server]:
    """A second server that checks credentials (IAM), with a bucket the right key may read."""
    with s3_server(enforce_iam=True) as server:
        server.client().create_bucket(Bucket="shards")
        yield server


def _missing_bucket(s3: S3Server) -> tuple[dict, str, str]:
    return s3.env(), "s3://no-such-bucket/shapes", "the bucket no-such-bucket does not exist at http://127.0.0.1"


def _refused(s3: S3Server) -> tuple[dict, str, str]:
    return s3.env(AWS_ENDPOINT_URL=f"http://127.0.0.1:{free_port()}"), ROOT, "could not connect to the endpoint"


def _wrong_secret(s3: S3Server) -> tuple[dict, str, str]:
    return s3.env(AWS_SECRET_ACCESS_KEY="wrong"), ROOT, "access denied at http://127.0.0.1"


@pytest.mark.parametrize(
    "case", [_missing_bucket, _refused, _wrong_secret, None], ids=lambda c: c.__name__ if c else "silent"
)
def test_a_store_that_fails_ends_the_run_in_one_line_within_seconds(
    case, s3: S3Server, s3_iam: S3Server, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    run_dir = tmp_path / "run"
    (run_dir / "checkpoints").mkdir(parents=True)
    earlier = run_dir / "checkpoints" / "last.pt"
    earlier.write_bytes(b"an earlier run's checkpoint")
    with silent_endpoint() as silent:
        env, root, expected = (
            case(s3_iam if case is _wrong_secret else s3)
            if case
            else (s3.env(AWS_ENDPOINT_URL=silent), ROOT, "did not answer within 1 s x 2 tries (Read timeout")
        )
        for key, value in env.items():
            monkeypatch.setenv(key, value)
        started = time.monotonic()
        error = failure(*shards_args(root, "dataset.timeout_s=1", "train.epochs=2"), run_dir=run_dir)
        elapsed = time.monotonic() - started
    assert expected in str(error) and root in str(error), error
    assert elapsed < 15, f"{elapsed:.1f} s"  # bounded: 2 tries x 1 s per request, plus start-up
    assert earlier.read_bytes() == b"an earlier run's checkpoint"  # nothing overwritten
    assert sorted(p.name for p in run_dir.iterdir()) == ["checkpoints"]


UNUSABLE_SETTINGS = {
    "endpoint without a scheme": ({"AWS_ENDPOINT_URL": "alice:hunter2@127.0.0.1:9"}, "(Invalid endpoint: 127.0.0.1:9)"),
    "no such profile": ({"AWS_PROFILE": "nosuch"}, "(The config profile (nosuch) could not be found)"),
}


@pytest.mark.parametrize("case", UNUSABLE_SETTINGS)
def test_aws_settings_botocore_cannot_use_end_in_one_line_without_credentials(
    case: str, source: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys
) -> None:
    """botocore refuses them when it makes its client: that was a traceback, quoting the endpoint's password."""
    changes, expected = UNUSABLE_SETTINGS[case]
    env = {"AWS_ENDPOINT_URL": "http://127.0.0.1:9", "AWS_SECRET_ACCESS_KEY": "fake+secret", **changes}
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    error = failure(*shards_args(ROOT), run_dir=tmp_path / "run")
    assert isinstance(error, ConfigError) and expected in str(error) and "check AWS_ENDPOINT_URL" in str(error), error
    assert pack(source, ROOT) == 2
    err = capsys.readouterr().err.strip()
    assert err == f"error: {error}" and not [s for s in ("alice", "hunter2", "fake+secret") if s in err], err


@pytest.mark.slow  # three runs from object storage: about 20 s
def test_a_run_stopped_mid_epoch_resumes_from_object_storage_bit_identically(
    aws: S3Server, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    args = shards_args(ROOT, "train.epochs=2", "system.deterministic=true", f"dataset.cache_dir={tmp_path}/cache")
    run(compose_cfg(*args, output_dir=str(tmp_path / "straight")))
    stop_after_step_5(monkeypatch, args, tmp_path / "part")
    run(compose_cfg(*args, output_dir=str(tmp_path / "part")))
    straight = torch.load(tmp_path / "straight" / "checkpoints" / "last.pt", weights_only=True)
    resumed = torch.load(tmp_path / "part" / "checkpoints" / "last.pt", weights_only=True)
    assert straight["progress"]["step"] == resumed["progress"]["step"] == 16
    assert all(torch.equal(tensor, resumed["model"][key]) for key, tensor in straight["model"].items())
