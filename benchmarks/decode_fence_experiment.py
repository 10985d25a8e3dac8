"""Does the GPU decode stress test see the hazard the fence closes? Run it with the fence, and without.

Runs the two decode stress tests of tests/test_gpu.py twice each: as they are, and with
`device_data._fenced_decode` replaced by a bare `decode_jpeg` call. A test that fails without the fence and
passes with it can see the nvJPEG stream-order bug (pytorch/vision#9606). Needs CUDA; prints one line a run.

    PYTHONPATH=src python benchmarks/decode_fence_experiment.py
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

from torchvision.io import ImageReadMode, decode_jpeg

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
import test_gpu  # noqa: E402

import imgtrain.data.gpu_decode as device_data  # noqa: E402
from imgtrain.data.shapes import ensure_shapes  # noqa: E402

TESTS = (
    "test_gpu_decode_never_overwrites_memory_that_queued_kernels_still_read",
    "test_gpu_decode_stream_matches_isolated_decodes_beside_training_kernels",
)


def unfenced(encoded, device):
    return decode_jpeg(encoded, mode=ImageReadMode.RGB, device=device)


def main() -> None:
    root = Path(ensure_shapes(tempfile.mkdtemp(), 96, 480, 96, 0))
    fenced = device_data._fenced_decode
    for name in TESTS:
        for fence in (False, True):
            device_data._fenced_decode = fenced if fence else unfenced
            try:
                getattr(test_gpu, name)(root)
                print(f"{name} fence={fence}: passed", flush=True)
            except AssertionError as error:
                print(f"{name} fence={fence}: FAILED {str(error).splitlines()[0]}", flush=True)
    device_data._fenced_decode = fenced


if __name__ == "__main__":
    main()
