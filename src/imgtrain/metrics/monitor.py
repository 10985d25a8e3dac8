"""Background sampling of GPU utilisation/memory (NVML) and CPU/RSS/PSS (psutil, /proc) during training.

Why not torch.cuda.utilization()? It maps integer CUDA_VISIBLE_DEVICES entries to NVML indexes directly, but
CUDA orders GPUs fastest first by default and NVML by PCI bus, so on a mixed machine it can read another
GPU; it also calls nvmlInit on every read. The mapping below matches torch's own device UUID to NVML's,
exactly, and falls back to the ordinal rules only where the UUID is unavailable.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import psutil
import torch

from imgtrain.host.cpus import available_cpus
from imgtrain.metrics.memory import TreeMemory, forked_children

logger = logging.getLogger(__name__)

GPU_KEYS = ("gpu/util_pct", "gpu/mem_used_gb")
SYS_KEYS = ("sys/cpu_pct", "sys/proc_cpu_pct", "sys/rss_gb")  # in every sample
PSS_KEY = "sys/pss_gb"  # only in the background thread's PSS samples (every ~5 s), where the platform has PSS
PEAK_KEYS = ("sys/rss_gb", PSS_KEY)  # memory peaks span the whole run: warm-up memory is memory too


def normalize_uuid(uuid: Any) -> str:
    """Return a GPU UUID as lower-case hex without a "GPU-" prefix (accepts str, bytes or torch's _CUuuid)."""
    text = uuid.decode("ascii", "replace") if isinstance(uuid, bytes) else str(uuid)
    text = text.strip().strip("\0").lower()
    return text[4:] if text.startswith("gpu-") else text


def _strtoul(text: str) -> int:
    """Parse a leading run of digits like C strtoul (as CUDA does); -1 when there is none."""
    digits = len(text) - len(text.lstrip("0123456789"))
    return int(text[:digits]) if digits else -1


def parse_visible_devices(env: str | None, num_nvml_devices: int) -> list[int | str]:
    """Parse CUDA_VISIBLE_DEVICES like the CUDA runtime: integer ordinals or (partial) GPU-/MIG- UUIDs."""
    if env is None:
        return list(range(num_nvml_devices))
    entries = [e.strip() for e in env.split(",")]
    out: list[int | str] = []
    if entries[0].startswith(("GPU-", "MIG-")):
        prefix = entries[0][:4]
        for entry in entries:
            if not entry.startswith(prefix):  # anything else ends the list
                break
            if entry in out:  # a repeated id makes the whole set empty
                return []
            out.append(entry)
        return out
    for entry in entries:
        ordinal = _strtoul(entry)
        if ordinal < 0:  # the first invalid entry ends the list
            break
        if ordinal in out:
            return []
        out.append(ordinal)
    return out


def nvml_index_for(
    torch_index: int,
    visible_devices: str | None,
    nvml_uuids: Sequence[str | bytes],
    torch_uuid: Any = None,
) -> int | None:
    """Map a torch CUDA ordinal to an NVML device index, or None if it cannot be resolved (e.g. MIG)."""
    known = [normalize_uuid(u) for u in nvml_uuids]
    if torch_uuid is not None and str(torch_uuid).strip():
        # Exact and independent of CUDA_VISIBLE_DEVICES / CUDA_DEVICE_ORDER. A MIG instance's UUID does
        # not match any physical GPU, and guessing the parent would mislabel its numbers, so give up.
        wanted = normalize_uuid(torch_uuid)
        return known.index(wanted) if wanted in known else None
    visible = parse_visible_devices(visible_devices, len(known))
    if not 0 <= torch_index < len(visible):
        return None
    entry = visible[torch_index]
    if isinstance(entry, int):
        # Integer ordinals follow CUDA_DEVICE_ORDER (FASTEST_FIRST by default) while NVML uses PCI order;
        # they agree on homogeneous boxes (ties broken by PCI bus id), which is all this fallback assumes.
        return entry if entry < len(known) else None
    if entry.startswith("MIG-"):
        return None
    matches = [i for i, u in enumerate(known) if u.startswith(normalize_uuid(entry))]
    return matches[0] if len(matches) == 1 else None  # CUDA accepts unique UUID prefixes


def _torch_uuid(index: int) -> Any:
    """Return torch's UUID for CUDA device `index`, or None where the property is missing."""
    try:
        return getattr(torch.cuda.get_device_properties(index), "uuid", None)
    except Exception:  # a missing property just means "use the fallback"
        return None


class _Stats:
    """Running sum/count/max per metric key."""

    def __init__(self) -> None:
        self.sums: dict[str, float] = {}
        self.counts: dict[str, int] = {}
        self.maxes: dict[str, float] = {}
        self.count = 0

    def add(self, sample: dict[str, float]) -> None:
        """Accumulate one sample."""
        self.count += 1
        for key, value in sample.items():
            self.sums[key] = self.sums.get(key, 0.0) + value
            self.counts[key] = self.counts.get(key, 0) + 1
            self.maxes[key] = max(self.maxes.get(key, -math.inf), value)

    def mean(self, key: str) -> float | None:
        """Mean of `key` over the samples that had it (a key can vanish if NVML fails mid-run)."""
        return self.sums[key] / self.counts[key] if key in self.sums else None

    def means(self) -> dict[str, float]:
        """Mean of every key seen."""
        return {key: self.sums[key] / self.counts[key] for key in self.sums}


class ResourceMonitor:
    """Daemon thread sampling GPU util/memory (NVML) and CPU %/RSS/PSS of this process tree (psutil, /proc)."""

    def __init__(self, device: torch.device, interval_s: float = 0.5) -> None:
        self.device = torch.device(device)
        self.interval_s = float(interval_s)
        self.gpu_available = False
        self._nvml: Any = None
        self._handle: Any = None
        self._lock = threading.Lock()  # guards the accumulators
        self._sample_lock = threading.Lock()  # one sample at a time (psutil/NVML state)
        self._window = _Stats()
        self._summary = _Stats()
        self._stop_event = threading.Event()
        self._thread: threading.Thread | None = None
        self._stopped = False
        self._sample_error_logged = False
        self._proc = psutil.Process()
        self._children: dict[int, psutil.Process] = {}
        self._memory = TreeMemory()  # PSS, and the copy-on-write warning; only ever on this monitor's thread
        # 100 % of sys/proc_cpu_pct = every CPU this process may run on is busy.
        self._ncpus = available_cpus()
        # cpu_percent(interval=None) measures since the previous call: prime it so the first sample is real.
        psutil.cpu_percent(interval=None)
        self._proc.cpu_percent(interval=None)
        self._init_nvml()

    def _init_nvml(self) -> None:
        """Find the NVML handle of the device in use; log once and carry on without GPU keys otherwise."""
        if self.device.type != "cuda":
            logger.info("Device is %s: gpu/util_pct and gpu/mem_used_gb will not be logged", self.device)
            return
        try:
            import pynvml

            pynvml.nvmlInit()
        except Exception as exc:  # ImportError, NVMLError (no driver/library), ...
            logger.warning("NVML unavailable (%s): gpu/util_pct and gpu/mem_used_gb will not be logged", exc)
            return
        self._nvml = pynvml
        try:
            torch_index = self.device.index if self.device.index is not None else torch.cuda.current_device()
            uuids = [
                pynvml.nvmlDeviceGetUUID(pynvml.nvmlDeviceGetHandleByIndex(i))
                for i in range(pynvml.nvmlDeviceGetCount())
            ]
            env = os.environ.get("CUDA_VISIBLE_DEVICES")
            index = nvml_index_for(torch_index, env, uuids, _torch_uuid(torch_index))
            if index is None:
                raise LookupError(f"no NVML device matches {self.device} (CUDA_VISIBLE_DEVICES={env!r})")
            self._handle = pynvml.nvmlDeviceGetHandleByIndex(index)
            pynvml.nvmlDeviceGetUtilizationRates(self._handle)  # fails early e.g. on MIG (NOT_SUPPORTED)
        except Exception as exc:
            logger.warning("NVML unavailable (%s): gpu/util_pct and gpu/mem_used_gb will not be logged", exc)
            self._handle = None
            self._shutdown_nvml()
            return
        self.gpu_available = True
        logger.info("ResourceMonitor: %s is NVML device %d", self.device, index)

    def _shutdown_nvml(self) -> None:
        """Balance our nvmlInit (NVML is reference counted)."""
        if self._nvml is not None:
            with contextlib.suppress(Exception):
                self._nvml.nvmlShutdown()
            self._nvml = None

    def _sample(self, pss: bool = False, final: bool = False) -> dict[str, float]:
        """One sample, never through torch.cuda (no GPU sync); `pss` (when due): monitor thread only, it is slow."""
        with self._sample_lock:
            sample: dict[str, float] = {}
            if self.gpu_available and self._nvml is not None:
                try:
                    sample["gpu/util_pct"] = float(self._nvml.nvmlDeviceGetUtilizationRates(self._handle).gpu)
                    # Device-wide: includes other processes and the driver/context reserve.
                    sample["gpu/mem_used_gb"] = self._nvml.nvmlDeviceGetMemoryInfo(self._handle).used / 1e9
                except Exception as exc:
                    logger.warning("NVML query failed (%s): gpu/* metrics disabled from now on", exc)
                    sample.clear()
                    self.gpu_available = False
            sample["sys/cpu_pct"] = float(psutil.cpu_percent(interval=None))
            proc_cpu, rss = self._proc_tree_usage()
            sample["sys/proc_cpu_pct"] = min(100.0, proc_cpu / self._ncpus)
            sample["sys/rss_gb"] = rss / 1e9
            children = dict(self._children)
        if pss:
            self._add_pss(sample, children, final)
        return sample

    def _add_pss(self, sample: dict[str, float], children: dict[int, psutil.Process], final: bool) -> None:
        """Add sys/pss_gb if due; outside the sample lock, so a window() sample never waits for this one."""
        now = time.monotonic()
        if self._memory.due(now, list(children), final):
            forked = forked_children(self._proc, children.values())
            total = self._memory.sample(now, self._proc.pid, list(children), forked)
            if total is not None:
                sample[PSS_KEY] = total / 1e9

    def _proc_tree_usage(self) -> tuple[float, int]:
        """CPU % (in units of one core) and RSS bytes of this process plus all descendants."""
        cpu = self._proc.cpu_percent(interval=None)
        rss = self._proc.memory_info().rss
        try:
            current = self._proc.children(recursive=True)
        except psutil.Error:
            current = []
        children: dict[int, psutil.Process] = {}
        for child in current:
            cached = self._children.get(child.pid)
            # Reuse the cached object (cpu_percent needs two calls on it); Process equality also checks
            # the create time, so a recycled pid gets a fresh object.
            proc = cached if cached is not None and cached == child else child
            try:
                cpu += proc.cpu_percent(interval=None)  # 0.0 on the first call for a new child
                # RSS counts shared pages (fork copy-on-write, shared libs) in every process, so the
                # sum is an upper bound on real usage; PSS (sys/pss_gb) is exact, sampled less often.
                rss += proc.memory_info().rss
            except psutil.Error:  # exited, zombie or not ours
                continue
            children[child.pid] = proc
        self._children = children
        return cpu, rss

    def _record(self, sample: dict[str, float], window: bool = True) -> None:
        """Add a sample to the window (unless `window` is False) and summary accumulators."""
        with self._lock:
            if window:
                self._window.add(sample)
            self._summary.add(sample)

    def _run(self) -> None:
        """Thread body: sample every interval until stopped, then one last PSS sample for the summary."""
        while not self._stop_event.wait(self.interval_s):
            self._guarded(lambda: self._record(self._sample(pss=True)))
        self._guarded(lambda: self._record(self._sample(pss=True, final=True), window=False))

    def _guarded(self, action: Callable[[], None]) -> None:
        """Run `action`; a failure is logged once and otherwise ignored (monitoring must not stop training)."""
        try:
            action()
        except Exception:
            if not self._sample_error_logged:
                logger.exception("ResourceMonitor sample failed; continuing")
                self._sample_error_logged = True

    def start(self) -> ResourceMonitor:
        """Take one sample now and start the background thread."""
        if self._thread is not None or self._stopped:
            return self
        self._record(self._sample())
        self._thread = threading.Thread(target=self._run, name="ResourceMonitor", daemon=True)
        self._thread.start()
        return self

    def window(self) -> dict[str, float]:
        """Means of each key since the previous call (a fresh sample if there is none; {} after stop)."""
        with self._lock:
            empty = self._window.count == 0
        if empty and not self._stopped:
            self._record(self._sample())
        with self._lock:
            stats, self._window = self._window, _Stats()
        return stats.means()

    def reset_summary(self) -> None:
        """Start the whole-run summary afresh (e.g. when warm-up steps are over); memory peaks carry over."""
        with self._lock:
            fresh = _Stats()
            fresh.maxes = {key: value for key, value in self._summary.maxes.items() if key in PEAK_KEYS}
            self._summary = fresh

    def summary(self) -> dict[str, float | None]:
        """Means since the last reset_summary() (or start); memory peaks since start."""
        with self._lock:
            empty = self._summary.count == 0
        if empty and not self._stopped:
            self._record(self._sample())
        with self._lock:
            stats = self._summary
            return {
                "gpu_util_mean": stats.mean("gpu/util_pct"),
                "gpu_mem_used_max_gb": stats.maxes.get("gpu/mem_used_gb"),
                "cpu_pct_mean": stats.mean("sys/cpu_pct"),
                "proc_cpu_pct_mean": stats.mean("sys/proc_cpu_pct"),
                "rss_peak_gb": stats.maxes.get("sys/rss_gb"),
                "pss_peak_gb": stats.maxes.get(PSS_KEY),  # None where the platform has no PSS
                "num_samples": stats.count,
            }

    def stop(self) -> None:
        """Stop and join the thread, then shut NVML down; idempotent."""
        if self._stopped:
            return
        self._stopped = True
        self._stop_event.set()
        if self._thread is not None:
            self._thread.join(timeout=max(5.0, 2 * self.interval_s))
        with self._sample_lock:
            self._shutdown_nvml()

    def __enter__(self) -> ResourceMonitor:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
