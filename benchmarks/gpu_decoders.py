"""make gpu-check's decoder part: decode-only images/s of each JPEG decoder on the mixed folder (benchmarks/photos.py),
in batches of 256, in interleaved rounds (medians and spreads), with each GPU decoder's time on its stream and how
busy NVML saw the GPU and its JPEG engines, and whether region decoding gave the full decode's crops.

The decoders, where they exist (on a GPU; without one, the host's alone, so that a test can smoke it):
  torchvision            torchvision's batched `decode_jpeg(device='cuda')`, whole images (dataset.gpu_decoder's
                         default), fenced as the training path fences it;
  nvimgcodec             nvImageCodec as dataset.gpu_decoder=nvimgcodec decodes: the hardware engine (0.9 of each
                         batch), its CUDA decoder, the host; by region where its probe allowed it, else whole;
  hardware whole/region  nvImageCodec's hardware engine alone;
  cuda whole/region      nvImageCodec's CUDA decoder alone;
  host whole/region      nvImageCodec's libjpeg-turbo, one thread;
  cpu path               what a DataLoader worker decodes (data/scaled_decode.py: scaled decoding on), one core.
Each region is the training crop's window (RandomResizedCrop at 224 px, from each file's seed): what the training
path decodes. A pass decodes every batch, header reading and region planning included; `chosen` is nvimgcodec
when its slowest round beats torchvision's fastest, torchvision when a GPU measured it otherwise, None without a
GPU. `python benchmarks/gpu_decoders.py --folder DIR` runs it alone; gpu_check.py
calls `decoder_part`.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import pynvml
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
from imgtrain.common.errors import ConfigError  # noqa: E402
from imgtrain.data import codec_engine, gpu_decode, region_decode, region_probe, resample  # noqa: E402
from imgtrain.data import decoders as decoders_module  # noqa: E402
from imgtrain.data.batched import CropSpec  # noqa: E402
from imgtrain.data.scaled_decode import decode_for_crop  # noqa: E402

CROP = CropSpec(224, (0.08, 1.0), flip_p=0.5)  # the training crop whose windows the region decoders decode
SAMPLE_S = 0.02  # NVML's readings while a pass runs, one every 20 ms


class Batch:
    """One batch of files as bytes, with what each decoder starts from: tensors (torchvision), the seeds."""

    def __init__(self, files: list[bytes], first_seed: int) -> None:
        self.files = files
        self.tensors = [torch.frombuffer(bytearray(data), dtype=torch.uint8) for data in files]
        self.seeds = np.arange(first_seed, first_seed + len(files), dtype=np.int64)


def regions_of(engine: codec_engine.CodecDecoder, batch: Batch) -> tuple[list[Any], np.ndarray]:
    """The batch's code streams and each one's training-crop window, as RegionBatchDecoder makes them."""
    streams = engine.streams(batch.tensors)
    stored = np.array([(s.height, s.width) for s in streams], dtype=np.int64)
    plan = resample.plan_batch(stored[:, 0], stored[:, 1], batch.seeds, CROP)
    bounds, _ = resample.plan_in_windows(plan, CROP.size)
    return streams, region_decode.stored_regions(bounds, np.ones(len(streams), dtype=np.int64), stored)


def nvimgcodec_decoder(engine: codec_engine.CodecDecoder, by_region: bool) -> Callable[[Batch], int]:
    def decode(batch: Batch) -> int:
        streams, regions = regions_of(engine, batch)
        return sum(image is not None for image in engine.decode(streams, regions if by_region else None))

    return decode


def cpu_path(batch: Batch) -> int:
    """A worker's decode, scaled decoding on: each file for its training crop, one after another."""
    for data, path_seed in zip(batch.tensors, batch.seeds.tolist(), strict=True):
        decode_for_crop(data, "photo.jpg", None, path_seed, CROP)
    return len(batch.tensors)


def candidates(device: torch.device) -> tuple[dict[str, Callable[[Batch], int]], dict[str, str], dict[str, Any]]:
    """(name -> one batch's decode, name -> why a decoder was not measured, name -> its region check)."""
    decoders: dict[str, Callable[[Batch], int]] = {}
    missing: dict[str, str] = {}
    checks: dict[str, Any] = {}
    cuda = device.type == "cuda"
    if cuda:
        decoders["torchvision"] = lambda batch: len(gpu_decode.decode_jpegs(batch.tensors, device))
    else:
        missing["torchvision"] = "no CUDA device"
    kinds = [("nvimgcodec", None), ("hardware", ("hardware",)), ("cuda", ("cuda",))] if cuda else []
    kinds.append(("host", ("cpu",)))
    for name, backends in kinds:
        try:
            engine = codec_engine.CodecDecoder(device, backends, threads=0 if cuda else 1)
        except (ImportError, RuntimeError) as error:  # no extra, or a backend this GPU lacks
            missing[name] = str(error).strip().splitlines()[0][:160]
            continue
        if name == "nvimgcodec":
            allowed = codec_engine.regions_allowed(engine)  # the probe, once, as the training path asks it
            decoders[name] = nvimgcodec_decoder(engine, by_region=allowed)
            checks[name] = {"probe_allowed_regions": allowed}
            continue
        decoders[f"{name} whole"] = nvimgcodec_decoder(engine, by_region=False)
        decoders[f"{name} region"] = nvimgcodec_decoder(engine, by_region=True)
        checks[f"{name} region"] = {"engine": engine}
    if not cuda:
        missing |= {name: "no CUDA device" for name in ("nvimgcodec", "hardware", "cuda")}
    try:
        decoders_module.cpu_decoder("the CPU path")  # full-scale files go to TorchCodec (or torchvision's)
        decoders["cpu path"] = cpu_path
    except ConfigError as error:  # no CPU decoder here: the other decoders are measured all the same
        missing["cpu path"] = str(error)[:160]
    return decoders, missing, checks


def region_matches(engine: codec_engine.CodecDecoder, batch: Batch) -> dict[str, Any]:
    """The first batch by region and whole: the largest difference of a region from its whole image's crop."""
    streams, regions = regions_of(engine, batch)
    try:
        parts, wholes = engine.decode(streams, regions), engine.decode(streams)
    except RuntimeError as error:
        return {"region_matches_full": False, "why": str(error).strip()[:160]}
    crops = [None if w is None else w[:, t:b, left:r] for w, (t, b, left, r) in zip(wholes, regions, strict=True)]
    worst = region_decode.region_difference(parts, crops)
    refused = sum(p is None for p in parts)
    matched = worst <= region_probe.REGION_TOLERANCE
    return {"region_matches_full": matched, "region_max_difference": worst, "regions_refused": refused}


class NvmlSampler:
    """NVML's utilization of the GPU (the share of time a kernel ran) and of its JPEG engines, read every SAMPLE_S
    while a pass runs; None where NVML or the reading is unavailable."""

    def __init__(self, device: torch.device) -> None:
        self.handle = None
        if device.type == "cuda":
            try:
                pynvml.nvmlInit()
                self.handle = pynvml.nvmlDeviceGetHandleByUUID(f"GPU-{torch.cuda.get_device_properties(device).uuid}")
            except Exception:  # noqa: BLE001 - NVML missing or another device: the figures are left out
                self.handle = None
        self.readings: list[tuple[float | None, float | None]] = []
        self.stop = threading.Event()

    def _read(self) -> tuple[float | None, float | None]:
        gpu = jpeg = None
        try:
            gpu = float(pynvml.nvmlDeviceGetUtilizationRates(self.handle).gpu)
            jpeg = float(pynvml.nvmlDeviceGetJpgUtilization(self.handle)[0])
        except Exception:  # noqa: BLE001 - a driver without the JPEG engines' counter
            pass
        return gpu, jpeg

    def run(self, work: Callable[[], dict[str, Any]]) -> dict[str, Any]:
        """`work()`'s figures, with NVML's mean readings while it ran."""
        if self.handle is None:
            return work() | {"gpu_busy_pct": None, "jpeg_engines_pct": None}
        self.readings, self.stop = [], threading.Event()
        thread = threading.Thread(target=self._sample, daemon=True)
        thread.start()
        try:
            figures = work()
        finally:
            self.stop.set()
            thread.join()
        for key, k in (("gpu_busy_pct", 0), ("jpeg_engines_pct", 1)):
            values = [r[k] for r in self.readings if r[k] is not None]
            figures[key] = round(statistics.mean(values), 1) if values else None
        return figures

    def _sample(self) -> None:
        while not self.stop.wait(SAMPLE_S):
            self.readings.append(self._read())


HOST = ("host whole", "host region", "cpu path")  # decode on the host: one batch a pass, no stream time


def load_batches(folder: Path, batch_size: int, batches: int) -> list[Batch]:
    """The first `batches` batches of the folder's training files (sorted), read into memory."""
    paths = sorted((folder / "train").rglob("*.jpg"))[: batch_size * batches]
    if not paths:
        raise FileNotFoundError(f"{folder}/train holds no JPEG: generate the mixed folder first (benchmarks/photos.py)")
    files = [path.read_bytes() for path in paths]
    return [Batch(files[i : i + batch_size], i) for i in range(0, len(files), batch_size)]


def one_pass(decode: Callable[[Batch], int], batches: list[Batch], stream_timed: bool) -> dict[str, float | None]:
    """Every batch decoded once: images/s over the pass (the GPU drained at both ends, not between batches), and
    the median batch's time on the current CUDA stream (CUDA events around each call)."""
    if stream_timed:
        torch.cuda.synchronize()
    events, count, started = [], 0, time.perf_counter()
    for batch in batches:
        start = torch.cuda.Event(enable_timing=True) if stream_timed else None
        if start is not None:
            start.record()
        count += decode(batch)
        if start is not None:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            events.append((start, end))
    if stream_timed:
        torch.cuda.synchronize()
    wall = time.perf_counter() - started
    stream_ms = statistics.median(s.elapsed_time(e) for s, e in events) if events else None
    return {"images_per_s": count / wall, "stream_ms_per_batch": stream_ms, "decoded": count}


def decoder_part(
    folder: Path,
    device: str | None = None,
    batch_size: int = 256,
    batches: int = 8,
    rounds: int = 3,
    limit_s: float = 60.0,
) -> dict[str, Any]:
    """The decoder part's report (the module's docstring): JSON-ready, `decoders` one entry per decoder, `chosen`
    the dataset.gpu_decoder value to use (None without a GPU). Rounds stop at `limit_s`; a decoder no round
    reached is left out with why."""
    started = time.monotonic()
    target = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    loaded = load_batches(folder, batch_size, batches)
    decoders, missing, checks = candidates(target)
    sampler, cuda = NvmlSampler(target), target.type == "cuda"
    measured: dict[str, list[dict]] = {name: [] for name in decoders}
    for decode in decoders.values():  # warm-up: handles, CUDA context, allocators; not timed
        decode(loaded[0])
    regions = {name: region_matches(c.pop("engine"), loaded[0]) if "engine" in c else c for name, c in checks.items()}
    done = 0
    while done < rounds and time.monotonic() - started <= limit_s:
        for name, decode in decoders.items():  # interleaved: each round times every decoder once
            host = name in HOST
            measured[name].append(
                sampler.run(partial(one_pass, decode, loaded[:1] if host else loaded, cuda and not host))
            )
        done += 1
    rows = [_row(name, measured[name], regions.get(name, {})) for name in decoders if measured[name]]
    rows += [{"decoder": name, "not_measured": why} for name, why in missing.items()]
    return {
        "device": torch.cuda.get_device_name(target) if cuda else "cpu",
        "batch_size": batch_size,
        "batches": len(loaded),
        "files": sum(len(b.files) for b in loaded),
        "rounds": done,
        "decoders": rows,
        "chosen": choose(rows) if cuda else None,
        "seconds": round(time.monotonic() - started, 1),
    }


def _row(name: str, passes: list[dict], region: dict[str, Any]) -> dict[str, Any]:
    rates = [p["images_per_s"] for p in passes]
    pick = lambda key: statistics.median(v) if (v := [p[key] for p in passes if p.get(key) is not None]) else None  # noqa: E731
    row = {
        "decoder": name,
        "images_per_s": round(statistics.median(rates), 1),
        "spread": [round(min(rates), 1), round(max(rates), 1)],
        "stream_ms_per_batch": _rounded(pick("stream_ms_per_batch")),
        "gpu_busy_pct": _rounded(pick("gpu_busy_pct")),
        "jpeg_engines_pct": _rounded(pick("jpeg_engines_pct")),
        "decoded_per_pass": passes[-1]["decoded"],
    }
    return row | region


def _rounded(value: float | None) -> float | None:
    return None if value is None else round(value, 2)


def choose(rows: list[dict[str, Any]]) -> str | None:
    """nvimgcodec when its slowest round beats torchvision's fastest (measured as the training path would decode:
    by region where its probe allowed it, else whole); torchvision otherwise; None when torchvision was not."""
    by_name = {row["decoder"]: row for row in rows if "images_per_s" in row}
    torchvision, ours = by_name.get("torchvision"), by_name.get("nvimgcodec")
    if torchvision is None:
        return None
    if ours and ours["spread"][0] > torchvision["spread"][1]:
        return "nvimgcodec"
    return "torchvision"


def table_lines(report: dict[str, Any]) -> list[str]:
    """The report as a markdown table, one row per decoder."""
    lines = [
        f"Decoders on {report['device']}: {report['files']} files in batches of {report['batch_size']}, "
        f"{report['rounds']} interleaved rounds; chosen: {report['chosen']}",
        "",
        "| decoder | images/s (median) | spread | stream ms/batch | GPU busy % | JPEG engines % | region = full crop |",
        "| --- | ---: | --- | ---: | ---: | ---: | --- |",
    ]
    for row in report["decoders"]:
        if "not_measured" in row:
            lines.append(f"| {row['decoder']} | not measured: {row['not_measured']} | | | | | |")
            continue
        match = row.get("region_matches_full", row.get("probe_allowed_regions"))
        cells = [row["images_per_s"], "-".join(str(v) for v in row["spread"]), row["stream_ms_per_batch"]]
        cells += [row["gpu_busy_pct"], row["jpeg_engines_pct"], "" if match is None else match]
        lines.append(f"| {row['decoder']} | " + " | ".join("" if c is None else str(c) for c in cells) + " |")
    return lines


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--folder", type=Path, required=True, help="the mixed folder (benchmarks/photos.py)")
    parser.add_argument("--device", help="cuda or cpu (default: cuda where there is one)")
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--batches", type=int, default=8, help="batches a GPU decoder decodes per round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--limit-s", type=float, default=60.0, help="no round starts later")
    parser.add_argument("--json", type=Path, help="also write the report here")
    args = parser.parse_args(argv)
    report = decoder_part(args.folder, args.device, args.batch_size, args.batches, args.rounds, args.limit_s)
    report["table"] = table_lines(report)  # gpu-check's table takes it as it is (its process imports no torch)
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))
    print("\n".join(table_lines(report)))


if __name__ == "__main__":
    main()
