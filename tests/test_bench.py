"""The benchmark harness's quick mode, as a smoke test: every section runs and is reported (no timing checks)."""

from __future__ import annotations

import importlib
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import ROOT


@pytest.mark.slow  # the whole harness, quick: about 3 minutes on 2 cores
def test_quick_benchmark_runs_every_section(tmp_path: Path) -> None:
    out_json, out_md = tmp_path / "bench.json", tmp_path / "BENCH.md"
    cmd = [sys.executable, "benchmarks/bench.py", "--quick", f"--workdir={tmp_path / 'work'}"]
    cmd += [f"--json={out_json}", f"--markdown={out_md}"]
    result = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(out_json.read_text())
    assert report["machine"]["cpu_count"] >= 1 and report["machine"]["torch"] == torch.__version__
    overhead = report["overhead"]
    assert overhead["train_py"][0] > 0 and overhead["bare_loop"][0] > 0 and "overhead" in overhead
    modes = {(row["dataset"], row["mode"]): row for row in report["modes"]}
    for dataset in ("synthetic", "shapes", "imagefolder"):
        for mode in ("loader", "compute", "train"):
            assert modes[(dataset, mode)]["images_per_sec"] > 0, modes[(dataset, mode)]
    assert modes[("shapes", "train, data.device_resident=true")]["images_per_sec"] > 0
    assert [row["num_workers"] for row in report["workers"]][:2] == [0, 1]
    assert all(row["images_per_sec"] > 0 for row in report["workers"])
    breakdown = report["breakdown"]
    assert all(v > 0 for mode in ("loader", "train") for v in breakdown[mode]["on"] + breakdown[mode]["off"])
    assert "cost" in breakdown["train"] and breakdown["clocks"]["us_per_image_on"][0] > 0
    assert breakdown["loader_pipeline"]["stage_ms_per_image"]["decode"] > 0
    ckpt = {row["variant"]: row for row in report["checkpoint"]["rows"]}
    assert all(row["images_per_sec"] > 0 for row in ckpt.values()) and ckpt["off"]["saves_per_run"] == [0]
    assert ckpt["defaults"]["saves_per_run"] == [1]  # the end of the run (no improvement seen: one epoch)
    gpu_rows = [*report["gpu_ceilings"], *report["gpu_jpeg"]["rows"]]
    assert {row["key"] for row in gpu_rows} >= {"r18_ceiling", "r18_resident", "r50_ceiling", "r50_jpeg_cuda"}
    if not torch.cuda.is_available():
        assert all(row["note"].startswith("not measured") for row in gpu_rows)
    storage = {(row["format"], row["store"]): row for row in report["storage"]["rows"]}
    stores = ("page cache", "slow") if report["storage"]["slow_store"] == "measured" else ("page cache",)
    assert all(storage[(f, s)]["images_per_sec_per_worker"] > 0 for f in ("folder", "shards") for s in stores)
    if "slow" in stores:  # 5 ms per open: the folder pays it per image, so its read stage shows it
        assert storage[("folder", "slow")]["read_ms_per_image"] > 4 > storage[("shards", "slow")]["read_ms_per_image"]
    decoders = report["decode_cpu"]["decoders"].values()
    assert len(decoders) == 2 and all(d["median"] > 0 for d in decoders)
    assert report["decode_cpu"]["pixel_difference_mean"] < 1  # the same JPEGs, the same pixels near enough
    assert len(report["resize_kernels"]["rows"]) == 6
    ways = ("v2 per sample", "uint8 resize per image", "roi_align per batch")
    assert all(row[way]["median"] > 0 for row in report["resize_kernels"]["rows"] for way in ways)
    per_core = report["per_core"]["summary"]
    assert set(per_core) == {"bare", "torchvision per sample", "loader"}
    assert all(row["images_per_sec"]["median"] > 0 and row["x_bare"]["median"] > 0 for row in per_core.values())
    loaders = {(row["policy"], row["workers"]): row for row in report["augment_loaders"]["rows"]}
    assert set(loaders) == {("rrc_flip", 1), ("trivialaugment", 1), ("randaugment", 1)}
    assert all(row["ours"]["median"] > 0 and row["ours_stage_ms"]["decode"] > 0 for row in loaders.values())
    if report["augment_loaders"]["timm"]["note"] == "measured":  # the peer kit's wheel is there
        assert all(row["timm"]["median"] > 0 and row["ratio"]["median"] > 0 for row in loaders.values())
        assert loaders[("randaugment", 1)]["timm_profile_ms"]["RandAugment"] > 0
    cost = {row["variant"]: row for row in report["recipe_cost"]["rows"]}
    assert len(cost) == 4 and all(row["step_ms"]["median"] > 0 for row in cost.values())
    assert cost["baseline"]["ratio"] is None and cost["both"]["ratio"]["median"] > 0
    text = out_md.read_text()
    assert "(quick mode: a smoke test, not figures to quote)" in text and "### (c) Loader throughput" in text
    assert "### (d) GPU" in text and "### (e) GPU" in text and "### Checkpoint cost" in text
    assert "### Cost of the stage breakdown" in text and "### (f) Storage" in text
    assert "### CPU JPEG decode" in text and "### Crop-and-resize kernels" in text
    assert "### Augmentation policies: our training loader against timm" in text
    assert "### Cost of mixup/cutmix and EMA per step" in text
    photos = {(row["set"], row["use"], row["method"]) for row in report["big_photos"]["rows"]}
    assert {("6mp", "train", "scaled"), ("imagenet", "val", "full")} <= photos
    assert all(row["images_per_sec"] > 0 for row in report["big_photos"]["rows"])
    assert "### Big photos" in text and "- photos, scaled >= 1.3x the full decode:" in text


def test_only_runs_the_sections_named(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    bench = importlib.import_module("bench")
    out_json = tmp_path / "bench.json"
    args = ["--quick", "--only", "gpu-ceilings,gpu-jpeg", f"--workdir={tmp_path / 'work'}", f"--json={out_json}"]
    assert bench.main([*args, f"--markdown={tmp_path / 'BENCH.md'}"]) == 0
    report = json.loads(out_json.read_text())
    assert report["sections"] == ["gpu-ceilings", "gpu-jpeg"]
    assert "overhead" not in report and "modes" not in report and "gpu_ceilings" in report
    with pytest.raises(SystemExit) as caught:
        bench.main(["--only", "gpu"])
    assert caught.value.code == 2


def test_augment_loaders_without_the_timm_wheel_say_why(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    recipes = importlib.import_module("recipes")
    monkeypatch.setenv("IMGTRAIN_TIMM_WHEEL", str(tmp_path / "no-such.whl"))
    path, why = recipes.install_timm(tmp_path)
    assert path is None and why.startswith("not measured: no timm wheel at") and "no-such.whl" in why
    rows = [recipes._loader_row("randaugment", 1, {"ours": [{"images_per_sec": 100.0}], "timm": []})]
    folder = {"train_files": 60, "size": [160, 120], "kib_per_image": 9.0}
    result = {"folder": folder, "crop": 64, "batch": 8, "measured_batches": 2, "rounds": 1, "rows": rows}
    result["timm"] = {"version": "1.0.28", "note": why}
    text = "\n".join(recipes.render({"augment_loaders": result}))
    assert why in text and "| randaugment | `rand-m9-n2` | 1 | 100 (100-100) | — | — | 100 | — | — |" in text


@pytest.mark.slow  # renders 6- and 12-MP photos and decodes each several ways: about 10 s on 2 cores
def test_scaled_decode_measures_every_decoder_at_the_factor_each_use_needs(tmp_path: Path) -> None:
    """benchmarks/scaled_decode.py: every set and use has a row per decoder, and the factors are those the uses
    need (12 MP validated at 1/8: 3000 // 256 = 11; ImageNet's 375-px side at 1/1)."""
    out = tmp_path / "scaled.json"
    cmd = [sys.executable, "benchmarks/scaled_decode.py", "--files=1", "--rounds=1", f"--json={out}"]
    result = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    rates = json.loads(out.read_text())["rates"]
    assert set(rates) == {f"{name} {use}" for name in ("6mp", "12mp", "imagenet") for use in ("rrc", "val")}
    for row in rates.values():
        assert {"torchcodec (full)", "PIL (full)", "PIL draft (scaled)"} <= set(row) and row["factors"]
        assert all(rate[0] > 0 for key, rate in row.items() if key != "factors")
    assert rates["12mp val"]["factors"] == [8] and rates["6mp val"]["factors"] == [4]
    assert rates["imagenet val"]["factors"] == [1] and rates["imagenet rrc"]["factors"] == [1]
    assert "| 12mp val (factor 8) | torchcodec (full) |" in result.stdout
