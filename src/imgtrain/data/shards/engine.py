"""The streaming engine, LitData (pinned in pyproject.toml), and the five settings of it this template depends on.

Why LitData and not WebDataset or MosaicML streaming: docs/shards.md, "Why LitData".
Each workaround below was found by testing LitData 0.2.76 against a local S3-compatible server (moto); each is
covered by tests/test_shards_s3.py, so a LitData upgrade that changes the behaviour fails there first.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import os
import time
from collections.abc import Iterator
from typing import Any

import litdata
import psutil
from botocore.config import Config as BotoConfig
from litdata.processing import data_processor
from litdata.streaming import downloader
from litdata.streaming.serializers import _SERIALIZERS, Serializer

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


class Refused(Serializer):
    """4. Stands in for every LitData serializer that imgtrain shards do not use. LitData picks each field's decoder
    by the name the shard's index gives (`data_format`), and some of them run code when they load (pickle, and
    others through it). The index is checked before a run reads anything (manifest.py); this keeps an index changed
    after that check, or a dataset opened without it, from reaching any other decoder: LitData sets up each
    decoder an index names before it reads a sample, and this one refuses there."""

    def __init__(self, name: str) -> None:
        self.name = name

    def setup(self, metadata: Any) -> None:
        raise ValueError(f"the shard's index asks for LitData's {metadata!r} decoder, which imgtrain shards never use")

    def serialize(self, item: Any) -> tuple[bytes, str | None]:
        raise ValueError(f"imgtrain shards do not write LitData's {self.name!r} format")

    def deserialize(self, data: bytes) -> Any:
        raise ValueError(f"the shard asks for LitData's {self.name!r} decoder, which imgtrain shards never use")

    def can_serialize(self, item: Any) -> bool:
        return False


def serializers(allowed: set[str]) -> dict[str, Serializer]:
    """LitData's `serializers` argument: its own for the `allowed` formats, `Refused` for every other."""
    return {name: Refused(name) for name in _SERIALIZERS if name not in allowed}


def _on_sigint(processor: Any, signum: int, frame: Any) -> None:
    """5. LitData's `optimize` replaces SIGINT's handler with one that ends the process at once with status 0 (its
    `_signal_handler`), so a Ctrl-C'd conversion looked finished to a script, skipped every `finally` and left its
    staging folder and its message behind. Here a worker process ends quietly, and the main process gets the
    KeyboardInterrupt Python gives by default, which the converter turns into clean-up and one line."""
    if multiprocessing.parent_process() is not None:  # one of LitData's workers: the main process cleans up
        os._exit(128 + signum)
    raise KeyboardInterrupt


data_processor.DataProcessor._signal_handler = _on_sigint


def started_processes() -> set[int]:
    """The processes running under this one (children, and theirs)."""
    return {process.pid for process in psutil.Process().children(recursive=True)}


def stop_processes(before: set[int], timeout_s: float = 5.0) -> None:
    """End every process started under this one since `before`: the workers of an `optimize` that was stopped,
    which would go on writing into the destination and the staging folder, and the downloader each worker starts
    (it keeps the worker's end-of-life pipe open, so joining the worker alone waits for ever). SIGTERM first (a
    worker ends at once, see `_on_sigint` and staging.stops), SIGKILL after `timeout_s`."""
    tree = [process for process in psutil.Process().children(recursive=True) if process.pid not in before]
    for process in tree:
        with contextlib.suppress(psutil.NoSuchProcess):
            process.terminate()
    ours = [child for child in multiprocessing.active_children() if child.pid in {p.pid for p in tree}]
    deadline = time.monotonic() + timeout_s
    while any(_running(process) for process in tree if process.pid not in {c.pid for c in ours}):
        if time.monotonic() > deadline:
            for process in tree:
                with contextlib.suppress(psutil.NoSuchProcess):
                    process.kill()
            break
        time.sleep(0.05)
    for child in ours:  # joined through multiprocessing, which reaps them and forgets them
        child.join(timeout_s)
        if child.is_alive():
            child.kill()
            child.join()


def _running(process: psutil.Process) -> bool:
    try:
        return process.status() != psutil.STATUS_ZOMBIE  # a zombie has ended: only its parent has yet to reap it
    except psutil.NoSuchProcess:
        return False
