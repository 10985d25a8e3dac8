"""gpu-check's tests section: which GPU tests it runs, and what their JUnit XML (or, for a run cut before pytest
wrote it, their verbose log) says of each.
"""

from __future__ import annotations

import re
import xml.etree.ElementTree as ElementTree
from pathlib import Path

T, A, N = "tests/test_gpu.py::", "tests/test_gpu_augment.py::", "tests/test_gpu_decode_cuda.py::"
SYNC = f"{T}test_no_host_device_sync_between_two_logging_windows"
# The GPU tests gpu-check runs by default, by the CUDA path each covers, the quick ones first and the compiling
# ones last (a cut run loses those first). `make test-gpu` runs every GPU test in 4-5 minutes (16 in 3 on
# 2026-11-23); left out here: the resume tests (fp32, bf16, fp16: checkpoints, not CUDA paths), fp16's no-sync
# case, test_bf16_channels_last_compiled_trains (the no-sync `compiled` case compiles the same model, channels_last
# and bf16, one compilation fewer), the NVML tests (every row reports NVML's figures), shards (no LitData on the GPU
# box), torchrun on nccl (one process), the profiler's kernel trace and the compiling tests (COMPILING).
# tests/test_gpu_check.py checks that every name here is collected.
GPU_TESTS = {
    "prefetcher": (f"{T}test_prefetcher_batches_are_bit_identical_to_a_plain_copy", f"{SYNC}[prefetcher]"),
    "device-resident data": (f"{T}test_device_resident_loader_matches_the_cpu_reference", f"{SYNC}[device_resident]"),
    "decode=cuda": (
        f"{T}test_gpu_decode_matches_the_cpu_decode_within_tolerance",
        f"{T}test_gpu_decode_never_overwrites_memory_that_queued_kernels_still_read",
        f"{T}test_gpu_decode_stream_matches_isolated_decodes_beside_training_kernels",
        f"{T}test_truncated_and_cmyk_jpegs_are_skipped_and_counted",
        f"{SYNC}[decode_cuda]",
    ),
    "device crop and erasing": (f"{A}test_device_crop_and_erasing_match_the_cpu_within_rounding", f"{SYNC}[shapes]"),
    "EXIF on nvJPEG, scaled JPEGs cropped on the device": (
        "tests/test_scaled_decode.py::test_on_a_gpu_nvjpeg_turns_exif_and_the_device_crops_scaled_images",
    ),
    "the default path": (f"{SYNC}[default]",),
    "mixup/EMA": (f"{SYNC}[recipe]",),
    "dataset.gpu_decoder=nvimgcodec": (
        f"{N}test_nvimgcodec_regions_on_the_gpu_crop_what_torchvision_crops[train]",
        f"{N}test_nvimgcodec_decodes_never_overwrite_memory_that_queued_kernels_still_read",
        f"{N}test_nvimgcodec_writes_into_torch_without_a_copy",
    ),
}
# The compiling tests (61 s of the 2026-11-27 call, on an H200): with --tests all, or `make test-gpu`. The rows
# compile the same models (r50_ceiling_compiled, the CUDA-graphs rows), so a compilation that fails shows there
COMPILING = (
    f"{SYNC}[compiled]",  # compiled, channels_last, bf16, with mixup/cutmix, EMA and erasing on the GPU
    f"{T}test_cuda_graphs_train_tune_and_validate",
)
COLLECTED = re.compile(r"^(tests/\S+::\S+)$", re.M)  # `pytest --collect-only -q`'s lines
VERBOSE = re.compile(r"^(tests/\S+::\S+) (PASSED|FAILED|SKIPPED|ERROR|XFAIL|XPASS)\b", re.M)


def selected(which: str) -> list[str]:
    """The node ids to pass pytest: the stated selection, or none (with -m gpu: every GPU test) for "all"."""
    return [] if which == "all" else list(dict.fromkeys(t for tests in GPU_TESTS.values() for t in tests))


def _node_id(case: ElementTree.Element) -> str:
    module = case.get("classname", "").replace(".", "/")
    return f"{module}.py::{case.get('name')}"


def from_junit(path: Path) -> dict[str, dict]:
    """{node id: {"status", "seconds", "message"}} from pytest's JUnit XML."""
    results = {}
    for case in ElementTree.parse(path).getroot().iter("testcase"):
        if not case.get("name"):  # the test SIGINT interrupted: recorded with no name, it did not pass
            continue
        status, message = "passed", ""
        for child, name in (("failure", "failed"), ("error", "error"), ("skipped", "skipped")):
            found = case.find(child)
            if found is not None:
                status, message = name, (found.get("message") or "").strip().splitlines()[:1]
                message = message[0] if message else ""
                break
        results[_node_id(case)] = {"status": status, "seconds": float(case.get("time", 0)), "message": message}
    return results


def from_log(text: str) -> dict[str, dict]:
    """The same from `pytest -v`'s lines, for a run that ended before writing its XML."""
    names = {"PASSED": "passed", "FAILED": "failed", "ERROR": "error", "SKIPPED": "skipped"}
    return {node: {"status": names.get(word, word.lower())} for node, word in VERBOSE.findall(text)}


def summary(xml: Path, log: Path, wanted: list[str]) -> dict:
    """Counts, the failed and errored tests' names with their first line, and the selected tests with no result."""
    results = from_junit(xml) if xml.exists() else {}
    source = "junit" if results else "log"
    if not results and log.exists():
        results = from_log(log.read_text(errors="replace"))
    count = lambda status: sum(1 for r in results.values() if r["status"] == status)  # noqa: E731
    failed = {node: r.get("message", "") for node, r in results.items() if r["status"] in ("failed", "error")}
    skipped = sorted({r.get("message", "") for r in results.values() if r["status"] == "skipped"} - {""})
    return {
        "read_from": source,
        "passed": count("passed"),
        "failed": failed,
        "skipped": count("skipped"),
        "skip_reasons": skipped[:5],
        "not_reached": [node for node in wanted if node not in results],
        "results": results,
    }
