"""The streaming engine, LitData (pinned in pyproject.toml), and the three settings of it this template depends on.

Why LitData and not WebDataset or MosaicML streaming: README, "When your data outgrows a local folder".
Each workaround below was found by testing LitData 0.2.76 against a local S3-compatible server (moto); each is
covered by tests/test_shards_s3.py, so a LitData upgrade that changes the behaviour fails there first.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator

import litdata
from botocore.config import Config as BotoConfig
from litdata.streaming import downloader

from imgtrain.data.shards.store import ATTEMPTS

# 1. Plain-http endpoints (MinIO, Ceph, moto on a laptop): LitData downloads chunks and uploads them with obstore,
#    whose fixed client options replace obstore's own AWS_ALLOW_HTTP, so every http:// endpoint fails with
#    "BadScheme" (same root cause as developmentseed/obstore#159). Allowing http changes nothing for https.
#    Set at import, so that spawned DataLoader workers, which import this module to unpickle the dataset, get it.
downloader._OBSTORE_CLIENT_OPTIONS["allow_http"] = "true"

# LitData logs its internal choices at INFO (cache sizing, POSIX fast paths); the run says what matters itself.
logging.getLogger("litdata").setLevel(logging.WARNING)


def storage_options(timeout_s: float) -> dict:
    """2. Bounded requests: LitData's boto3 client retries 1,000 times by default, so a store that does not answer
    hangs a run for hours; this client config (merged into LitData's) fails within `ATTEMPTS` x `timeout_s`."""
    config = BotoConfig(
        connect_timeout=timeout_s, read_timeout=timeout_s, retries={"total_max_attempts": ATTEMPTS, "mode": "standard"}
    )
    return {"config": config}


@contextlib.contextmanager
def scratch_env(folder: str) -> Iterator[None]:
    """3. LitData stages the chunks of a conversion bound for object storage in one fixed folder (/tmp/chunks,
    DATA_OPTIMIZER_CACHE_FOLDER), shared by every conversion on the machine: give this one its own."""
    saved = {key: os.environ.get(key) for key in ("DATA_OPTIMIZER_CACHE_FOLDER", "DATA_OPTIMIZER_DATA_CACHE_FOLDER")}
    os.environ["DATA_OPTIMIZER_CACHE_FOLDER"] = os.path.join(folder, "chunks")
    os.environ["DATA_OPTIMIZER_DATA_CACHE_FOLDER"] = os.path.join(folder, "data")
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def identity() -> dict[str, str]:
    return {"name": "litdata", "version": litdata.__version__}
