"""Does the GPU decode stress test see the hazard the fence closes? Run it with the fence, and without.

Runs the two decode stress tests of tests/test_gpu.py twice each: as they are, and with
`gpu_decode.fence` (the drain before every nvJPEG call) replaced by a no-op. A test that fails without the fence and
passes with it can see the nvJPEG stream-order bug (pytorch/vision#9606). Needs CUDA; prints one line a run.

    PYTHONPATH=src python benchmarks/decode_fence_experiment.py
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
import test_gpu  # noqa: E402

import imgtrain.data.gpu_decode as gpu_decode  # noqa: E402
from imgtrain.data.shapes import ensure_shapes  # noqa: E402

TESTS = (
    "test_gpu_decode_never_overwrites_memory_that_queued_kernels_still_read",
    "test_gpu_decode_stream_matches_isolated_decodes_beside_training_kernels",
)


def unfenced(device):
    """No drain: nvJPEG may write memory that kernels queued on the stream still read."""


def main() -> None:
    root = Path(ensure_shapes(tempfile.mkdtemp(), 96, 480, 96, 0))
    fenced = gpu_decode.fence
    for name in TESTS:
        for fence in (False, True):
            gpu_decode.fence = fenced if fence else unfenced
            try:
                getattr(test_gpu, name)(root)
                print(f"{name} fence={fence}: passed", flush=True)
            except AssertionError as error:
                print(f"{name} fence={fence}: FAILED {str(error).splitlines()[0]}", flush=True)
    gpu_decode.fence = fenced


if __name__ == "__main__":
    main()
