"""nvImageCodec's decoders as dataset.gpu_decoder=nvimgcodec makes them, and the question asked before it decodes
regions: does a region decode give what a full decode gives, cropped, on this machine?

nvImageCodec 0.9 fails region decodes on some GPUs where 0.8 worked: INTERNAL_ERROR on some, a segmentation fault
on others (NVIDIA/nvImageCodec#55). So on a GPU the probe runs once per process in a child process (`python -m
imgtrain.data.region_probe <device index>`), where a crash is an answer rather than the end of the run. This module
imports neither torch nor the data package, so the child starts in about a second.

The probe files are one JPEG of each kind the backends treat differently: baseline 4:2:0 (the hardware engine's
own), 4:2:2, 4:4:4, grayscale, progressive (refused by the engine: the CUDA decoder's), restart markers, and
4:1:1 (not the engine's either) where simplejpeg can write it; 123x170 px, partial blocks at the edges, the region
off the 8- and 16-pixel grid of the blocks.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.metadata
import importlib.util
import io
import json
import logging
import os
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from types import ModuleType
from typing import Any

import numpy as np
from PIL import Image

from imgtrain.host import optional

log = logging.getLogger(__name__)
# Optional, found by name: where installed, the probe also checks a 4:1:1 file (which PIL cannot write)
simplejpeg = importlib.import_module("simplejpeg") if importlib.util.find_spec("simplejpeg") else None

# The backends by name, in the order a decoder tries them: each file goes to the first that takes it
BACKEND_KINDS = {"hardware": "HW_GPU_ONLY", "cuda": "GPU_ONLY", "cpu": "CPU_ONLY"}
GPU_BACKENDS = ("hardware", "cuda", "cpu")  # the engine, the CUDA decoder behind it, libjpeg-turbo for the rest
CPU_BACKENDS = ("cpu",)  # no GPU (the tests, the benchmark's CPU half): libjpeg-turbo on the host
# The hardware engine's share of each batch, the rest to the CUDA decoder: DALI's default (hw_decoder_load=0.9;
# NVIDIA's MLPerf ResNet-50 sets 0.99 with 6 CPU threads per GPU). Not yet measured here.
HARDWARE_SHARE = 0.9
# A region decode may differ from the full decode's crop by this many levels (uint8) and still count as the same:
# libjpeg-turbo's is exact (0 on every probe kind); a GPU's is measured by the probe and reported
REGION_TOLERANCE = 1
PROBE_REGION = (13, 21, 101, 150)  # top, left, bottom, right (exclusive) in the 123x170 probe files
PROBE_TIMEOUT_S = 60.0  # the child: interpreter, CUDA context, seven small decodes


def import_codec(needed_by: str = "dataset.gpu_decoder=nvimgcodec") -> ModuleType:
    """`nvidia.nvimgcodec` (the gpu-decode extra), its logger quiet unless PYNVIMGCODEC_VERBOSITY says otherwise
    (1-5: its errors to its most detailed); missing, one line naming `needed_by` and the extra (MissingEngine)."""
    os.environ.setdefault("PYNVIMGCODEC_VERBOSITY", "0")
    with quiet_native_output():
        return optional.require("nvidia.nvimgcodec", needed_by)


@contextlib.contextmanager
def quiet_native_output() -> Iterator[None]:
    """What native code prints to stderr meanwhile, logged at debug level instead: nvImageCodec's extensions print
    that nvJPEG2000 and nvTIFF are missing (formats the template does not decode on the GPU) when a decoder is
    made. A file descriptor redirected, as Python's own writes would not catch a C library's."""
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as sink:
        os.dup2(sink.fileno(), 2)
        try:
            yield
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            sink.seek(0)
            text = sink.read(65536).decode(errors="replace").strip()
            if text:
                log.debug("nvImageCodec: %s", " | ".join(text.splitlines()))


def describe(backends: tuple[str, ...] = GPU_BACKENDS, share: float = HARDWARE_SHARE) -> str:
    """What dataset.gpu_decoder=nvimgcodec decodes with, for metrics.json's environment (read from the package's
    metadata: nothing imported)."""
    try:
        version = importlib.metadata.version("nvidia-nvimgcodec-cu13")
    except importlib.metadata.PackageNotFoundError:
        version = "(not installed)"
    chain = " > ".join(f"{name} ({share:g})" if name == "hardware" else name for name in backends)
    return f"nvImageCodec {version}: each crop's region, by region where its probe allows it ({chain})"


def make_decoder(
    codec: ModuleType, device_index: int | None, backends: tuple[str, ...], share: float, threads: int = 0
) -> Any:
    """An nvImageCodec Decoder on GPU `device_index` (None: the host alone) with these backends in order, the
    hardware engine given `share` of each batch; `threads`: its host threads (0: one per core, its default)."""
    chosen = [
        codec.Backend(getattr(codec.BackendKind, BACKEND_KINDS[name]), load_hint=share if name == "hardware" else 1.0)
        for name in backends
    ]
    device = codec.NVIMGCODEC_DEVICE_CPU_ONLY if device_index is None else device_index
    with quiet_native_output():
        return codec.Decoder(device_id=device, max_num_cpu_threads=threads, backends=chosen)


def decode_params(codec: ModuleType) -> Any:
    """RGB, interleaved, as stored: the caller turns each image upright from its EXIF orientation, as the other GPU
    path does, so a region is asked for in the stored image's coordinates whatever the backend."""
    return codec.DecodeParams(
        apply_exif_orientation=False, color_spec=codec.ColorSpec.SRGB, sample_format=codec.SampleFormat.I_RGB
    )


def probe_files() -> dict[str, bytes]:
    """One small JPEG of each kind (the module's docstring), photo-like: a smooth field and some texture."""
    y, x = np.mgrid[0:123, 0:170]
    rng = np.random.default_rng(0)
    field = np.stack([x * 1.5, y * 2.0, (x + y) * 0.8], axis=-1) + 40 * np.sin(x / 5.0)[..., None]
    pixels = np.clip(field + rng.normal(0, 12, field.shape), 0, 255).astype(np.uint8)
    files = {}
    for kind, options in {
        "baseline 4:2:0": {"subsampling": "4:2:0"},
        "4:2:2": {"subsampling": "4:2:2"},
        "4:4:4": {"subsampling": "4:4:4"},
        "progressive": {"progressive": True},
        "restart markers": {"restart_marker_blocks": 4},
    }.items():
        out = io.BytesIO()
        Image.fromarray(pixels).save(out, "JPEG", quality=90, **options)
        files[kind] = out.getvalue()
    out = io.BytesIO()
    Image.fromarray(pixels[..., 0]).save(out, "JPEG", quality=90)
    files["grayscale"] = out.getvalue()
    if simplejpeg is not None:
        files["4:1:1"] = simplejpeg.encode_jpeg(pixels, 90, "RGB", "411")
    return files


def compare_regions(codec: ModuleType, decoder: Any, files: dict[str, bytes], stream: int = 0) -> dict[str, Any]:
    """Each file decoded whole and by PROBE_REGION in two batched calls: {"matched", "max_difference" (levels),
    "failed" (the kinds that failed or differed), "error"}."""
    top, left, bottom, right = PROBE_REGION
    params = decode_params(codec)
    streams = [codec.CodeStream(data) for data in files.values()]
    regions = [s.get_sub_code_stream(region=codec.Region(top, left, bottom, right)) for s in streams]
    try:
        whole = decoder.decode(streams, params=params, cuda_stream=stream)
        parts = decoder.decode(regions, params=params, cuda_stream=stream)
    except RuntimeError as error:
        return {"matched": False, "max_difference": None, "failed": list(files), "error": str(error).strip()[:200]}
    worst, failed = 0.0, []
    for kind, full, part in zip(files, whole, parts, strict=True):
        if full is None or part is None:
            failed.append(kind)
            continue
        crop = np.asarray(full.cpu())[top:bottom, left:right].astype(np.int16)
        part = np.asarray(part.cpu()).astype(np.int16)
        difference = float(np.abs(crop - part).max()) if crop.shape == part.shape else float("inf")
        worst = max(worst, difference)
        if difference > REGION_TOLERANCE:
            failed.append(kind)
    return {"matched": not failed, "max_difference": worst, "failed": failed, "error": None}


def probe_here(device_index: int | None, backends: tuple[str, ...], share: float = HARDWARE_SHARE) -> dict[str, Any]:
    """The probe in this process (the host's backend cannot crash the way #55's GPUs do)."""
    codec = import_codec()
    return compare_regions(codec, make_decoder(codec, device_index, backends, share), probe_files())


def probe_in_child(device_index: int, backends: tuple[str, ...], share: float = HARDWARE_SHARE) -> dict[str, Any]:
    """The probe in a child process, bounded by PROBE_TIMEOUT_S: a crash or a hang is a failed probe."""
    command = [sys.executable, "-m", __name__, str(device_index), ",".join(backends), str(share)]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=PROBE_TIMEOUT_S, check=False)
    except subprocess.TimeoutExpired:
        return {"matched": False, "max_difference": None, "failed": [], "error": f"no answer in {PROBE_TIMEOUT_S:g} s"}
    lines = done.stdout.strip().splitlines()
    if done.returncode != 0 or not lines:
        died = f"killed by signal {-done.returncode}" if done.returncode < 0 else f"exit status {done.returncode}"
        last = (done.stderr.strip().splitlines() or [""])[-1][:200]
        return {"matched": False, "max_difference": None, "failed": [], "error": f"the probe {died}: {last}".strip()}
    return json.loads(lines[-1])


if __name__ == "__main__":  # the child: python -m imgtrain.data.region_probe <device index> <backends> <share>
    index, names, hardware_share = int(sys.argv[1]), tuple(sys.argv[2].split(",")), float(sys.argv[3])
    print(json.dumps(probe_here(index, names, hardware_share)))
