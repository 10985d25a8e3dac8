"""What a run ran on: versions, GPU, CPUs, limits, file systems, JPEG libraries (metrics.json's `environment`).

Every probe reads a file or asks a library once; one that fails gives None for its field, never an error.
The probes take their paths as arguments, so tests point them at small fake files.
"""

from __future__ import annotations

import ctypes
import os
import platform
import re
import resource
import socket
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import PIL
import pynvml
import torch
import torchvision
from PIL import features

from imgtrain.host.cpus import cpu_budget, cpu_quota
from imgtrain.host.slurm import current_job

T = TypeVar("T")

# fs types whose reads cross a network (or a VM boundary): each small image file pays a round trip or more
NETWORK_FS = {"nfs", "nfs4", "cifs", "smb3", "smbfs", "ceph", "glusterfs", "lustre", "gpfs", "beegfs", "9p", "afs"}
NETWORK_FS |= {"virtiofs", "davfs", "fuse.sshfs", "fuse.s3fs", "fuse.gcsfuse", "fuse.rclone", "fuse.juicefs"}
OVERLAY_FS = {"overlay", "aufs"}
TURBO_VERSION = re.compile(rb"libjpeg-turbo version ([0-9][0-9.]*)")
NVJPEG_PROPERTIES = 3  # nvjpegGetProperty: 0 major, 1 minor, 2 patch


@dataclass(frozen=True)
class ProbePaths:
    """Where the probes read (tests point them at fake files)."""

    shm: str = "/dev/shm"
    mountinfo: str = "/proc/self/mountinfo"
    cgroup: str = "/proc/self/cgroup"
    cgroup_root: str = "/sys/fs/cgroup"
    cpuinfo: str = "/proc/cpuinfo"
    maps: str = "/proc/self/maps"


def guarded(probe: Callable[..., T], *args: Any) -> T | None:
    """`probe(*args)`, or None when it fails in any way (a fingerprint never stops a run)."""
    try:
        return probe(*args)
    except Exception:
        return None


# ----------------------------------------------------------------------------- CPUs
def cpu_model(cpuinfo: str = "/proc/cpuinfo") -> str | None:
    """The first "model name" in /proc/cpuinfo (x86; None elsewhere)."""
    with open(cpuinfo) as f:
        for line in f:
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return None


# ----------------------------------------------------------------------------- memory, files, mounts
def shm_space(path: str = "/dev/shm") -> tuple[int, int]:
    """(total, free) bytes of the shared-memory file system the DataLoader workers hand batches over."""
    stat = os.statvfs(path)
    return stat.f_blocks * stat.f_frsize, stat.f_bavail * stat.f_frsize


def open_files_limit() -> tuple[int | None, int | None]:
    """(soft, hard) RLIMIT_NOFILE; None stands for unlimited."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    return (None if soft == resource.RLIM_INFINITY else soft), (None if hard == resource.RLIM_INFINITY else hard)


def _unescape(field: str) -> str:
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), field)  # mountinfo writes " " as \040


def mount_of(path: str, mountinfo: str = "/proc/self/mountinfo") -> tuple[str, str]:
    """(mount point, file system type) of the mount holding `path`: the longest mount point that prefixes it."""
    target = os.path.realpath(path)
    best = ("", "")
    for line in Path(mountinfo).read_text().splitlines():
        left, _, right = line.partition(" - ")
        point, fstype = _unescape(left.split()[4]), right.split()[0]
        inside = target == point or target.startswith(point.rstrip("/") + "/")
        if inside and len(point) >= len(best[0]):  # >=: a later mount on the same point hides the earlier one
            best = (point, fstype)
    if not best[0]:
        raise LookupError(f"no mount holds {path}")
    return best


def fs_kind(fstype: str | None) -> str | None:
    """The kind ("network", "FUSE", "overlay") of file systems slower than a local disk; None for the others."""
    if fstype in NETWORK_FS:
        return "network"
    if fstype is not None and (fstype == "fuse" or fstype.startswith("fuse.")):
        return "FUSE"
    return "overlay" if fstype in OVERLAY_FS else None


# ----------------------------------------------------------------------------- JPEG decoders
def _mapped_libraries(maps: str) -> list[str]:
    return sorted({line.split()[-1] for line in Path(maps).read_text().splitlines() if "jpeg" in line})


def _turbo_version(library: str) -> str | None:
    match = TURBO_VERSION.search(Path(library).read_bytes())  # the version string libjpeg-turbo embeds
    return match.group(1).decode() if match else None


def _nvjpeg_version(library: str) -> str:
    lib = ctypes.CDLL(library)  # already loaded by torchvision: this only looks it up
    values = []
    for prop in range(NVJPEG_PROPERTIES):
        value = ctypes.c_int()
        if lib.nvjpegGetProperty(prop, ctypes.byref(value)) != 0:
            raise OSError("nvjpegGetProperty failed")
        values.append(str(value.value))
    return ".".join(values)


def jpeg_decoders(decode: str, maps: str = "/proc/self/maps") -> dict[str, Any]:
    """The libjpeg-turbo versions behind TorchCodec (the CPU path's decoder), torchvision.io and Pillow, Pillow's
    version, and nvJPEG's when dataset.decode=cuda (torchvision's: TorchCodec's wheel maps one of its own too)."""
    libraries = guarded(_mapped_libraries, maps) or []
    # nvImageCodec's extensions (libjpeg_turbo_ext, libnvjpeg_ext) are its own, loaded once it decodes
    others = [p for p in libraries if "torchcodec" not in p and "nvimgcodec" not in p]
    torchcodec_jpeg = [p for p in libraries if "libjpeg" in p and "torchcodec" in p]
    torchvision_jpeg = [p for p in others if "libjpeg" in p and "pillow" not in p.lower() and "/PIL/" not in p]
    torchvision_jpeg.sort(key=lambda path: "torchvision" not in path)  # its wheel's own copy first
    nvjpeg = [p for p in others if "libnvjpeg" in p]
    return {
        "torchcodec_libjpeg_turbo": guarded(_turbo_version, torchcodec_jpeg[0]) if torchcodec_jpeg else None,
        "torchvision_libjpeg_turbo": guarded(_turbo_version, torchvision_jpeg[0]) if torchvision_jpeg else None,
        "pillow": PIL.__version__,
        "pillow_libjpeg_turbo": guarded(features.version, "libjpeg_turbo"),
        "nvjpeg": guarded(_nvjpeg_version, nvjpeg[0]) if decode == "cuda" and nvjpeg else None,
    }


# ----------------------------------------------------------------------------- versions and the device
def driver_version() -> str | None:
    """The NVIDIA driver's version (NVML), None without one."""
    pynvml.nvmlInit()
    try:
        version = pynvml.nvmlSystemGetDriverVersion()
        return version.decode() if isinstance(version, bytes) else str(version)
    finally:
        pynvml.nvmlShutdown()  # NVML counts its users: the resource monitor's own nvmlInit stays valid


def fingerprint(device: torch.device, decode: str, data_root: str | None, paths: ProbePaths) -> dict[str, Any]:
    """Versions, device, host, limits, the dataset's file system and the JPEG decoders (sizes in bytes)."""
    cuda = device.type == "cuda"
    soft, hard = guarded(open_files_limit) or (None, None)
    shm_total, shm_free = guarded(shm_space, paths.shm) or (None, None)
    mount, fstype = (guarded(mount_of, data_root, paths.mountinfo) if data_root else None) or (None, None)
    affinity, quota = cpu_budget().affinity, guarded(cpu_quota, paths.cgroup, paths.cgroup_root)
    return {
        "hostname": guarded(socket.gethostname),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torchvision": torchvision.__version__,
        "cuda": torch.version.cuda,
        "cudnn": guarded(torch.backends.cudnn.version) if cuda else None,
        "driver": guarded(driver_version) if cuda else None,
        "gpu_name": guarded(torch.cuda.get_device_name, device) if cuda else None,
        "cpu_model": guarded(cpu_model, paths.cpuinfo),
        "cpus_affinity": affinity,
        "cpu_quota": quota,
        "cpus_available": affinity if quota is None else min(affinity, quota),
        "shm_path": paths.shm,
        "shm_total_bytes": shm_total,
        "shm_free_bytes": shm_free,
        "data_root": data_root,
        "data_mount_point": mount,
        "data_fs_type": fstype,
        "open_files_soft": soft,
        "open_files_hard": hard,
        "sharing_strategy": guarded(torch.multiprocessing.get_sharing_strategy),
        "torch_threads": torch.get_num_threads(),
        "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
        "mkl_num_threads": os.environ.get("MKL_NUM_THREADS"),
        "decoder": jpeg_decoders(decode, paths.maps),
        "slurm": job.fields() if (job := guarded(current_job)) is not None else None,  # which job, index, attempt
    }
