"""Session fixtures shared by the tests."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from shardhelpers import pack

from imgtrain.data.shapes import ensure_shapes


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
