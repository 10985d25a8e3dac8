"""Session fixtures shared by the tests."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch


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
