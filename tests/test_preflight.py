"""Pre-flight checks and the environment fingerprint, against faked limits (no training)."""

from __future__ import annotations

import logging
import os
import resource
from pathlib import Path
from types import SimpleNamespace

import PIL
import pytest
import torch
from helpers import compose_cfg

from imgtrain.config.data import DataConfig
from imgtrain.config.validate import validate
from imgtrain.data import decoders
from imgtrain.data.loader import plan_loader
from imgtrain.data.pipeline import build_data
from imgtrain.host import cpus, dist
from imgtrain.host.cpus import cpu_quota, parse_cpu_max
from imgtrain.metrics.environment import ProbePaths, fingerprint, jpeg_decoders, mount_of
from imgtrain.metrics.preflight import LoaderLoad, check_cpus, check_filesystem, check_threads, preflight, warnings_for
from imgtrain.train import tune

CPU = torch.device("cpu")
GB = 10**9
# A big machine with room for everything: no check may warn.
AMPLE = {
    "cpus_affinity": 64,
    "cpu_quota": None,
    "cpus_available": 64,
    "shm_free_bytes": 64 * GB,
    "open_files_soft": 65536,
    "open_files_hard": 65536,
    "sharing_strategy": "file_descriptor",
    "data_fs_type": "ext4",
    "data_mount_point": "/",
    "torch_threads": 8,
    "omp_num_threads": None,
}


def _load(**changes) -> LoaderLoad:
    """8 workers x prefetch 2 of 256 ImageNet-size crops (38.5 MB each) on one process."""
    values = {
        "workers": 8,
        "local_ranks": 1,
        "shm_bytes": 8 * 2 * 256 * 3 * 224**2,
        "shm_detail": "1 training process x 8 workers x data.prefetch_factor=2 batches of 256 images",
        "shm_batch_key": "data.batch_size",
        "tensors": 8 * 2 * 2,
        "data_root": "/data/imagenet",
        "reads_files": True,
    }
    return LoaderLoad(**{**values, **changes})


def _absent(tmp_path: Path) -> ProbePaths:
    """Probe paths that do not exist: every probe of them must give None, not fail."""
    missing = str(tmp_path / "missing")
    return ProbePaths(shm=missing, mountinfo=missing, cgroup=missing, cpuinfo=missing, maps=missing)


def test_ample_resources_give_no_warnings() -> None:
    assert warnings_for(_load(), AMPLE) == []
    assert warnings_for(_load(workers=0, shm_bytes=0, tensors=0), AMPLE) == []


def test_a_small_shm_is_warned_of_before_the_bus_error(tmp_path: Path, monkeypatch, caplog) -> None:
    """The whole entry on a real (synthetic) loader plan, with /dev/shm faked as a 1 MB directory."""
    real_statvfs = os.statvfs
    tiny = SimpleNamespace(f_blocks=1000, f_bavail=1000, f_frsize=1000)  # 1 MB free
    monkeypatch.setattr(os, "statvfs", lambda p: tiny if str(p) == str(tmp_path) else real_statvfs(p))
    cfg = ["dataset=synthetic", "dataset.num_train=512", "dataset.num_val=64", "dataset.image_size=32"]
    settings = validate(compose_cfg(*cfg, "data.batch_size=16", "data.num_workers=0"))
    info = dist.DistInfo()
    data = build_data(settings, info, CPU, torch.contiguous_format, tmp_path)
    paths = ProbePaths(shm=str(tmp_path))
    assert not any("/dev/shm" in line for line in preflight(settings, info, CPU, data, paths=paths)["warnings"])
    with caplog.at_level(logging.WARNING, logger="imgtrain.metrics.preflight"):
        env = preflight(settings, info, CPU, data, num_workers=8, paths=paths)  # as a later choice of workers
    # 8 workers x prefetch 2 = 16 train batches of 16 x 3 x 32 x 32 bytes = 0.79 MB > 50% of 1 MB; val (64 images,
    # 2 batches of 32) holds less
    assert env["loader_shm_bytes"] == 16 * 16 * 3 * 32 * 32 and env["shm_free_bytes"] == 10**6
    (line,) = [w for w in env["warnings"] if w.startswith("/dev/shm")]
    assert "Bus error" in line and "--shm-size" in line and "16 train batches ahead" in line
    assert "data.prefetch_factor" in line and "data.num_workers" in line and "data.batch_size" in line
    assert line in caplog.messages


def test_fewer_cpus_than_workers(monkeypatch) -> None:
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0})
    env = fingerprint(CPU, "cpu", None, ProbePaths(cgroup="/nonexistent"))
    assert env["cpus_affinity"] == 1 and env["cpus_available"] == 1
    lines = warnings_for(_load(workers=2), env)
    assert any(line.startswith("3 busy processes") and "data.num_workers=0" in line for line in lines), lines


def test_a_cgroup_quota_below_the_affinity(tmp_path: Path) -> None:
    (tmp_path / "v2" / "job").mkdir(parents=True)
    (tmp_path / "v2" / "cpu.max").write_text("max 100000\n")
    (tmp_path / "v2" / "job" / "cpu.max").write_text("150000 100000\n")
    (tmp_path / "cgroup2").write_text("0::/job\n")
    assert cpu_quota(str(tmp_path / "cgroup2"), str(tmp_path / "v2")) == 1.5
    (tmp_path / "v1" / "cpu,cpuacct").mkdir(parents=True)
    (tmp_path / "v1" / "cpu,cpuacct" / "cpu.cfs_quota_us").write_text("400000\n")
    (tmp_path / "v1" / "cpu,cpuacct" / "cpu.cfs_period_us").write_text("100000\n")
    (tmp_path / "cgroup1").write_text("4:memory:/x\n3:cpu,cpuacct:/\n")
    assert cpu_quota(str(tmp_path / "cgroup1"), str(tmp_path / "v1")) == 4.0
    assert parse_cpu_max("max 100000") is None
    line = check_cpus(workers=7, local_ranks=1, affinity=64, quota=1.5)
    assert "cgroup CPU quota of 1.5" in line and "data.num_workers=0" in line and "auto" in line
    assert check_cpus(workers=7, local_ranks=2, affinity=64, quota=None) is None


def test_a_dataset_on_nfs(tmp_path: Path) -> None:
    root = tmp_path / "mnt" / "data set" / "imagenet"
    mounted = str(tmp_path / "mnt" / "data set")
    mountinfo = tmp_path / "mountinfo"
    mountinfo.write_text(
        "22 1 252:1 / / rw,relatime shared:1 - ext4 /dev/vda1 rw\n"
        f"95 22 0:52 / {mounted.replace(' ', chr(92) + '040')} rw,relatime shared:50 - nfs4 nas:/export rw,vers=4.2\n"
    )
    assert mount_of(str(root / "train"), str(mountinfo)) == (mounted, "nfs4")
    assert mount_of("/usr", str(mountinfo)) == ("/", "ext4")
    env = {**AMPLE, "data_fs_type": "nfs4", "data_mount_point": mounted}
    (line,) = warnings_for(_load(data_root=str(root)), env)
    assert "nfs4" in line and "network" in line and "local disk" in line
    assert warnings_for(_load(data_root=str(root), reads_files=False), env) == []  # CIFAR: read once, in memory
    assert check_filesystem("/data", "fuse.s3fs", "/data") and check_filesystem("/data", "overlay", "/")


def test_a_low_open_files_limit(monkeypatch) -> None:
    monkeypatch.setattr(resource, "getrlimit", lambda which: (256, 4096))
    env = {**AMPLE, **{k: v for k, v in fingerprint(CPU, "cpu", None, ProbePaths()).items() if "open_files" in k}}
    assert (env["open_files_soft"], env["open_files_hard"]) == (256, 4096)
    (line,) = warnings_for(_load(), env)
    assert "ulimit -n 4096" in line and "set_sharing_strategy('file_system')" in line
    assert warnings_for(_load(), {**env, "sharing_strategy": "file_system"}) == []
    assert warnings_for(_load(workers=0, shm_bytes=0, tensors=0), env) == []


def test_threads_oversubscribing_the_cpus() -> None:
    line = check_threads(threads=16, local_ranks=8, cpus=16, workers=1, omp=None)
    assert "each of 8 training processes" in line and "OMP_NUM_THREADS is unset" in line
    assert check_threads(threads=1, local_ranks=8, cpus=16, workers=1, omp="1") is None


def test_every_failed_probe_is_null(tmp_path: Path) -> None:
    env = fingerprint(CPU, "cpu", str(tmp_path), _absent(tmp_path))
    for key in ("cpu_model", "cpu_quota", "shm_total_bytes", "shm_free_bytes", "data_fs_type", "data_mount_point"):
        assert env[key] is None, key
    assert env["decoder"]["torchvision_libjpeg_turbo"] is None and env["decoder"]["pillow"] == PIL.__version__
    assert env["decoder"]["torchcodec_libjpeg_turbo"] is None
    assert env["torch"] == torch.__version__ and env["gpu_name"] is None and env["driver"] is None


def _mapped(name: str) -> bool:
    maps = Path("/proc/self/maps")
    return maps.exists() and any(name in line and "pillow" not in line for line in maps.read_text().splitlines())


@pytest.mark.skipif(not _mapped("libjpeg"), reason="torchvision maps no libjpeg of its own here")
def test_the_jpeg_libraries_of_this_process() -> None:
    decoders.cpu_decoder()  # TorchCodec is imported when a run first decodes: here, whatever ran before this test
    decoder = jpeg_decoders("cuda")
    assert decoder["torchvision_libjpeg_turbo"][0].isdigit()  # e.g. 3.1.3
    assert decoder["torchcodec_libjpeg_turbo"][0].isdigit()  # the CPU path's decoder
    if _mapped("libnvjpeg"):  # a CUDA build of torchvision: nvJPEG answers without a GPU
        assert decoder["nvjpeg"].split(".")[0].isdigit()
    assert jpeg_decoders("cpu")["nvjpeg"] is None  # only asked when dataset.decode=cuda


def test_auto_and_tune_count_a_containers_cpu_quota_and_say_so(tmp_path: Path, monkeypatch) -> None:
    """A container's view: 16 CPUs in the affinity mask, a cgroup v2 quota of 2.5 CPUs (docker --cpus=2.5).
    auto gives 1 worker (2 whole CPUs, one kept for training), tune probes up to 2, and the log says why."""
    (tmp_path / "v2" / "docker" / "abc").mkdir(parents=True)
    (tmp_path / "v2" / "docker" / "abc" / "cpu.max").write_text("250000 100000\n")
    (tmp_path / "cgroup").write_text("0::/docker/abc\n")
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(16)))
    monkeypatch.setattr(cpus, "CGROUP_FILE", str(tmp_path / "cgroup"))
    monkeypatch.setattr(cpus, "CGROUP_ROOT", str(tmp_path / "v2"))
    budget = cpus.cpu_budget()
    assert (budget.affinity, budget.quota, budget.usable) == (16, 2.5, 2) and cpus.available_cpus() == 2
    plan = plan_loader(DataConfig(num_workers="auto"), train=True, device_type="cpu")
    assert plan.kwargs["num_workers"] == 1
    assert (
        "2 CPUs available to this process, set by the cgroup CPU quota of 2.5 CPUs (16 in the affinity mask)"
        in (plan.notes[0])
    )
    assert tune.worker_candidates(local_world_size=1)[0] == [0, 1, 2]
    (tmp_path / "v2" / "docker" / "abc" / "cpu.max").write_text("max 100000\n")  # no quota: the mask counts
    assert cpus.cpu_budget().usable == 16 and "the CPU affinity mask" in cpus.cpu_budget().limited_by
    assert plan_loader(DataConfig(num_workers="auto"), train=True, device_type="cpu").kwargs["num_workers"] == 15
