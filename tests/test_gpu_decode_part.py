"""make gpu-check's decoder part (benchmarks/gpu_decoders.py), smoked on the CPU with the decoders there are: the
host's nvImageCodec, whole and by region, and the workers' decode; the GPU's named as not measured."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from imgtrain.data import region_probe
from imgtrain.host.optional import MissingEngine

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import gpu_decoders  # noqa: E402  benchmarks/gpu_decoders.py
import photos  # noqa: E402  benchmarks/photos.py

try:
    region_probe.import_codec()
except MissingEngine as missing:
    pytest.skip(str(missing), allow_module_level=True)


def test_the_decoder_part_measures_what_this_machine_has(tmp_path: Path) -> None:
    folder = photos.ensure_folder(tmp_path, photos.QUICK_COUNTS, scale=photos.QUICK_SCALE)
    report = gpu_decoders.decoder_part(folder, "cpu", batch_size=16, batches=2, rounds=2, limit_s=30)
    rows = {row["decoder"]: row for row in report["decoders"]}
    assert report["device"] == "cpu" and report["rounds"] == 2 and report["files"] == 32 and report["chosen"] is None
    for name in ("host whole", "host region", "cpu path"):
        assert rows[name]["images_per_s"] > 0 and rows[name]["decoded_per_pass"] == 16  # the host: one batch a pass
        assert rows[name]["spread"][0] <= rows[name]["images_per_s"] <= rows[name]["spread"][1]
    assert rows["host region"]["region_matches_full"] and rows["host region"]["region_max_difference"] == 0
    assert {rows[name]["not_measured"] for name in ("torchvision", "nvimgcodec", "hardware", "cuda")} == {
        "no CUDA device"
    }
    table = gpu_decoders.table_lines(report)
    assert len(table) == 4 + len(rows) and "| host region |" in table[5]


def test_nvimgcodec_is_chosen_only_when_all_its_rounds_are_faster() -> None:
    def rows(ours: list[float]) -> list[dict]:
        return [
            {"decoder": "torchvision", "images_per_s": 5000, "spread": [4800, 5200]},
            {"decoder": "nvimgcodec", "images_per_s": ours[1], "spread": ours, "probe_allowed_regions": False},
        ]

    assert gpu_decoders.choose(rows([5300, 7000])) == "nvimgcodec"  # whole images (no regions) as training would
    assert gpu_decoders.choose(rows([5100, 7000])) == "torchvision"  # its slowest round within torchvision's
    assert gpu_decoders.choose(rows([5300, 7000])[1:]) is None  # torchvision not measured: no GPU
