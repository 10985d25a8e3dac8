"""A pytest plugin for gpu-check's tests part (`-p gpu_select`): keep the collected tests whose node ids the file
named by IMGTRAIN_GPU_TESTS lists, deselect the rest, and write the listed ids pytest did not collect (renamed since
the selection was written) to IMGTRAIN_GPU_TESTS_MISSING. One collection, the run's own: passing the ids on the
command line would end the whole run at one that is missing, and a collect-only pass before it cost 18 s of a
GPU call (H200, 2026-11-27)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    listed = os.environ.get("IMGTRAIN_GPU_TESTS")
    if not listed:
        return
    wanted = json.loads(Path(listed).read_text())
    kept = [item for item in items if item.nodeid in wanted]
    config.hook.pytest_deselected(items=[item for item in items if item.nodeid not in wanted])
    items[:] = kept
    found = {item.nodeid for item in kept}
    missing = os.environ.get("IMGTRAIN_GPU_TESTS_MISSING")
    if missing:
        Path(missing).write_text(json.dumps([node for node in wanted if node not in found]))
