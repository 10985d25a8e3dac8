"""Session fixtures shared by the tests."""

from __future__ import annotations

import os
from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def data_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One generated-dataset cache for the whole session, outside the user's ~/.cache."""
    path = tmp_path_factory.mktemp("data")
    os.environ["IMGTRAIN_DATA_DIR"] = str(path)
    return path
