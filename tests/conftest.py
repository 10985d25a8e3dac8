"""Session fixtures shared by the tests."""

from __future__ import annotations

import os
from pathlib import Path

from imgtrain.host.cpus import available_cpus  # imports no torch

# Under pytest-xdist (make test: -n 2), each worker process gets its share of the CPUs for torch's threads, and
# so do the train.py processes it starts: two workers each using every core oversubscribe them (one run without
# this: 248 s, against 189 s in one process; with it, 1.76-1.79x faster than one process, two interleaved rounds
# on 2 cores, 2026-11-25). Set before torch is imported, which reads it.
if os.environ.get("PYTEST_XDIST_WORKER_COUNT") and "OMP_NUM_THREADS" not in os.environ:
    WORKERS = int(os.environ["PYTEST_XDIST_WORKER_COUNT"])
    os.environ["OMP_NUM_THREADS"] = str(max(1, available_cpus() // WORKERS))

import gpubox  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402
from shardhelpers import pack  # noqa: E402

from imgtrain.data.shapes import ensure_shapes  # noqa: E402


def pytest_report_header() -> str:
    """Say which device the run had: the gpu-marked tests skip without CUDA."""
    if not torch.cuda.is_available():
        return "CUDA: none (tests marked gpu are skipped; run them with `make test-gpu` on a GPU)"
    props = torch.cuda.get_device_properties(0)
    return f"CUDA: {props.name}, compute capability {props.major}.{props.minor}, torch {torch.__version__}"


@pytest.fixture(scope="session")
def data_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One generated-dataset cache for the whole session, outside the user's ~/.cache."""
    path = tmp_path_factory.mktemp("data")
    os.environ["IMGTRAIN_DATA_DIR"] = str(path)
    return path


@pytest.fixture(scope="session")
def gpu_box(tmp_path_factory: pytest.TempPathFactory) -> gpubox.Box:
    """The GPU box emulated (tests/gpubox.py): its site-packages, then the device wheels installed, once a session."""
    return gpubox.make_box(tmp_path_factory.mktemp("gpubox"))


@pytest.fixture(scope="session")
def source(data_dir: Path) -> Path:
    """256 train and 64 val JPEGs of 32 px in train/ and val/ folders (debug=fast's shapes)."""
    return Path(ensure_shapes(str(data_dir / "shards-src"), 32, 256, 64, 0))


@pytest.fixture(scope="session")
def shards(source: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """`source` converted once: read, never changed, by tests (copy it to damage it). Skips where the shards
    extra is missing (the GPU box)."""
    pytest.importorskip("litdata", reason="dataset=shards needs the shards extra: pip install -e '.[shards]'")
    dst = tmp_path_factory.mktemp("shards") / "shapes"
    assert pack(source, dst) == 0
    return dst
