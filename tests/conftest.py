"""Session fixtures shared by the tests."""

from __future__ import annotations

import gc
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

# CI (.ci/run sets CI=1) runs the fuzz targets on the same examples every time: a commit that passed there passes
# again, and a new find fails a developer's run (random examples, kept in .hypothesis/) rather than a landing.
# Hypothesis recommends this for CI; the GPU box, which lacks Hypothesis, has nothing to set.
try:
    from hypothesis import settings as hypothesis_settings

    hypothesis_settings.register_profile("ci", derandomize=True, database=None)
    if os.environ.get("CI"):
        hypothesis_settings.load_profile("ci")
except ImportError:
    pass

try:
    from xdist.scheduler import LoadScopeScheduling
except ImportError:  # NOVENV on the GPU box may lack pytest-xdist: one process, no scheduler
    LoadScopeScheduling = object

# Tests that share a module- or session-scoped fixture that costs seconds (a train.py or torchrun run, a training run
# in-process, an object-storage server holding converted shards, the GPU box's emulation), by node id prefix: under
# xdist each group goes to one worker, so its fixture is made once, not once in each worker that gets one of its
# tests (--dist load scatters a module's tests over the workers). xdist's own --dist loadgroup cannot do it here:
# it renames items through `_nodeid`, which pytest 9 no longer reads.
SHARED_FIXTURES = {
    "tests/test_ddp.py": "ddp_run",  # torchrun, 2 ranks
    "tests/test_gpu_check.py::test_a_passed_deadline": "gpu_box",  # site-packages copied, wheels installed
    "tests/test_gpubox.py": "gpu_box",
    "tests/test_resilience.py": "straight",  # train.py, 2 epochs
    "tests/test_shards_s3.py": "s3",  # moto's server and a conversion into it
    "tests/test_shards_trust.py": "s3 (trust)",  # moto's server
    "tests/test_slurm.py": "slurm",  # a Slurm cluster (tests/slurm_cluster.py) and every case run on it at once
    "tests/test_train_smoke.py": "smoke_run",  # train.py, 2 epochs
    "tests/test_trust.py": "checkpoint",  # a debug=fast run
}


class SharedFixtureScheduling(LoadScopeScheduling):
    """--dist load, but each group of SHARED_FIXTURES is one unit of work: every other test is a unit of its own,
    and the largest units are handed out first (their fixtures start while single tests fill the other worker)."""

    def _split_scope(self, nodeid: str) -> str:
        return next((group for prefix, group in SHARED_FIXTURES.items() if nodeid.startswith(prefix)), nodeid)


@pytest.hookimpl(optionalhook=True)  # an xdist hook: unknown, and never called, without it
def pytest_xdist_make_scheduler(config: pytest.Config, log: object) -> SharedFixtureScheduling | None:
    """make test's schedule (-n N gives --dist load); another --dist asked for keeps xdist's own."""
    return SharedFixtureScheduling(config, log) if config.getoption("dist") == "load" else None


def pytest_collection_finish(session: pytest.Session) -> None:
    """Move what the imports made (torch, Hydra, the test modules: a few hundred thousand objects that live as long
    as the process) out of the collector's sight: every full collection walked them again. With it, GC took 2.4 and
    2.8 s of test_trust, test_config and test_run in one process, against 9.7 and 10.4 s without (50.3 and 52.3 s
    against 58.5 and 59.9 s wall, interleaved, 2-core VM, 2026-11-28)."""
    gc.freeze()


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
