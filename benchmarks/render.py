"""The markdown section bench.py appends to BENCHMARKS.md: one dated section per invocation."""

from __future__ import annotations

import statistics
from pathlib import Path

import kernels  # benchmarks/kernels.py
import photos  # benchmarks/photos.py
import recipes  # benchmarks/recipes.py


def _rate(value: float | None) -> str:
    return f"{value:,.0f}" if value else "—"


def _share(value: float | None) -> str:
    return f"{value:.1%}" if value is not None else "—"


def _gpu(value: float | None) -> str:
    return f"{value:.0f}%" if value is not None else "n/a"


def render(report: dict, json_path: Path) -> str:
    m = report["machine"]
    quick = " (quick mode: a smoke test, not figures to quote)" if report["quick"] else ""
    lines = [
        "",
        f"## {m['date']} — {m['cpu_count']} CPUs, GPU: {m['gpu']}{quick}",
        "",
        f"`{report['command']}` on `{m['host']}` ({m['cpu']}), torch {m['torch']}, torchvision {m['torchvision']}, "
        f"Python {m['python']}. Raw results: `{json_path.name}`.",
        "",
    ]
    if "overhead" in report:
        lines += _overhead(report["overhead"])
    if "modes" in report:
        lines += _modes(report["modes"])
    if "workers" in report:
        lines += ["", "### (c) Loader throughput by `data.num_workers` (mode=loader, shapes)", ""]
        lines += ["| num_workers | images/s | data wait |", "| ---: | ---: | ---: |"]
        for row in report["workers"]:
            lines.append(
                f"| {row['num_workers']} | {_rate(row.get('images_per_sec'))} | {_share(row.get('data_wait_frac'))} |"
            )
    if "breakdown" in report:
        lines += _breakdown(report["breakdown"])
    if "checkpoint" in report:
        lines += _checkpoint(report["checkpoint"])
    if "gpu_ceilings" in report:
        lines += _gpu_rows("(d) GPU: ResNet-18 at 32 px and ResNet-50 at 224 px", report["gpu_ceilings"], "r18_ceiling")
    if "gpu_jpeg" in report:
        lines += _gpu_jpeg(report["gpu_jpeg"])
    if "storage" in report:
        lines += _storage(report["storage"])
    lines += kernels.render(report)
    lines += recipes.render(report)
    lines += [
        "",
        "Each row's command is in the JSON file. Images/s are steady state (after `metrics.skip_first_steps`), summed "
        "over ranks; data wait is the share of step time the loop spent waiting for a batch.",
        "",
    ]
    return "\n".join(lines)


def _modes(rows: list[dict]) -> list[str]:
    lines = ["", "### (b) Modes per dataset (steady-state images/s)", ""]
    lines += [
        "| dataset | mode | images/s | data wait | GPU util | CPU % | RSS GB |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for row in rows:
        rate, wait = _rate(row.get("images_per_sec")), _share(row.get("data_wait_frac"))
        lines.append(
            f"| {row['dataset']} | {row['mode']} | {rate} | {wait} "
            f"| {_gpu(row.get('gpu_util_mean'))} | {_gpu(row.get('cpu_pct_mean')).rstrip('%')} "
            f"| {row.get('rss_peak_gb') or 0:.2f} |" + (f" error: {row['error']}" if "error" in row else "")
        )
    return lines


def _gpu_rows(title: str, rows: list[dict], ceiling_key: str | None) -> list[str]:
    """One table of GPU rows; `ceiling_key` names the row the others are a share of (same model, same batch)."""
    ceiling = next((r.get("images_per_sec") for r in rows if r["key"] == ceiling_key), None)
    lines = ["", f"### {title}", ""]
    lines += [
        "| target | images/s | of ceiling | data wait | GPU util | steps | note |",
        "| --- | ---: | ---: | ---: | ---: | ---: | --- |",
    ]
    for row in rows:
        rate = row.get("images_per_sec")
        share = f"{rate / ceiling:.0%}" if rate and ceiling and row["key"].startswith(ceiling_key[:3]) else "—"
        note = row.get("note") or row.get("error") or row.get("verdict") or ""
        lines.append(
            f"| {row['target']} | {_rate(rate)} | {share} | {_share(row.get('data_wait_frac'))} "
            f"| {_gpu(row.get('gpu_util_mean'))} | {row.get('measured_steps') or '—'} | {note} |"
        )
    return lines


def _gpu_jpeg(result: dict) -> list[str]:
    lines = _gpu_rows("(e) GPU: ResNet-50 at 224 px from JPEG files", result["rows"], None)
    folder = result.get("folder")
    if folder:
        lines += ["", f"The folder: {photos.summary(folder)}."]
    timm = result.get("timm")
    if timm:
        ours = {row["key"]: row.get("images_per_sec") for row in result["rows"]}
        lines += ["", "**Against timm 1.0.28's `train.py`, same folder, same call on the GPU box:**", ""]
        if "error" in timm:
            lines.append(f"timm failed: {timm['error']}")
        else:
            rate = timm["images_per_sec"]
            lines += [
                "| run | images/s | ours / timm |",
                "| --- | ---: | ---: |",
                f"| timm `train.py` ({timm['measured_steps']} steps) | {_rate(rate)} | — |",
            ]
            labels = {
                "r50_jpeg_cpu": "ours, CPU decode",
                "r50_jpeg_cuda": "ours, dataset.decode=cuda",
                "r50_jpeg_cuda_compiled": "ours, dataset.decode=cuda, system.compile=true",
            }
            for key, label in labels.items():
                if ours.get(key):
                    lines.append(f"| {label} | {_rate(ours[key])} | {ours[key] / rate:.2f}x |")
        lines += ["", f"timm's command: `{timm['command']}`"]
    return lines


def _overhead(result: dict) -> list[str]:
    lines = ["### (a) Instrumentation overhead: train.py against a bare loop", ""]
    ours = ", ".join(_rate(v) for v in result["train_py"])
    bare = ", ".join(_rate(v) for v in result["bare_loop"])
    lines.append(
        f"ResNet-18 on `shapes` (the defaults), {result['steps']} steps, the first {result['warmup']} left out; "
        f"runs interleaved. train.py: {ours} img/s. `benchmarks/bare_loop.py`: {bare} img/s."
    )
    if "overhead" in result:
        lines += [
            "",
            f"**Medians: train.py {_rate(result['train_py_median'])} img/s, bare loop "
            f"{_rate(result['bare_loop_median'])} img/s: overhead {result['overhead']:+.1%}** (target: 3% or less).",
        ]
    if "overhead_pairs" in result:
        pairs = result["overhead_pairs"]
        lines += [
            "",
            f"Per interleaved pair (1 - train.py / bare loop): {', '.join(f'{p:+.1%}' for p in pairs)}; "
            f"median {result['overhead_pairs_median']:+.1%}, range {min(pairs):+.1%} to {max(pairs):+.1%}; "
            f"{result['pairs_favouring_bare']} of {len(pairs)} pairs favour the bare loop.",
        ]
    return lines


def _breakdown(result: dict) -> list[str]:
    lines = ["", f"### Cost of the stage breakdown (`data.stage_timings`, shapes, {result['steps']} steps per run)", ""]
    lines += ["| mode | on: images/s (median) | off | each run on | each run off | cost | clocks alone |"]
    lines += ["| --- | ---: | ---: | --- | --- | ---: | ---: |"]
    for mode in ("loader", "train"):
        row = result.get(mode, {})
        runs_on = ", ".join(_rate(v) for v in row.get("on", []))
        runs_off = ", ".join(_rate(v) for v in row.get("off", []))
        cost = f"{row['cost']:+.1%}" if row.get("cost") is not None else "-"
        clocks = f"{row['clock_share']:.2%}" if row.get("clock_share") is not None else "-"
        cells = [mode, _rate(row.get("on_median")), _rate(row.get("off_median")), runs_on, runs_off, cost, clocks]
        lines.append("| " + " | ".join(cells) + " |")
    clocks = result["clocks"]
    lines += [
        "",
        f"The clocks alone (in one process, loading and collating 2,048 shapes images, on and off alternating "
        f"{len(clocks['us_per_image_on'])} times): {clocks['cost_us_per_image']:+.1f} us per image "
        f"(medians {statistics.median(clocks['us_per_image_on']):.1f} on, "
        f"{statistics.median(clocks['us_per_image_off']):.1f} off). 'clocks alone' is that cost times the run's "
        "images/s: the share of a second the clocks take. Whole runs are interleaved; their spread on this machine "
        "is wider than the target of 1%.",
    ]
    return lines


def _checkpoint(result: dict) -> list[str]:
    lines = ["", f"### Checkpoint cost ({result['device']}, {result['steps']} steps per run, one epoch)", ""]
    lines += ["| checkpoints | images/s (median) | each run | saves per run | copy on the training thread (s) "]
    lines[-1] += "| background write (s) | cost |"
    lines += ["| --- | ---: | --- | --- | --- | --- | ---: |"]
    for row in result["rows"]:
        runs = ", ".join(_rate(v) for v in row["images_per_sec_runs"]) or row.get("error", "failed")
        writes = ", ".join(f"{v:.2f}" for v in row["write_s"]) or "-"
        copies = ", ".join(f"{v:.3f}" for v in row.get("copy_s", [])) or "-"
        cost = f"{row['cost']:+.1%}" if row.get("cost") is not None else "-"
        saves = ", ".join(str(v) for v in row["saves_per_run"])
        cells = [row["variant"], _rate(row["images_per_sec"]), runs, saves, copies, writes, cost]
        lines.append("| " + " | ".join(cells) + " |")
    for row in result["rows"]:
        if row.get("stall_per_save_s") is not None:
            stalls = ", ".join(f"{v:+.2f}" for v in row["stall_s"])
            lines += [
                "",
                f"**{row['variant']}: each save cost the training {row['stall_per_save_s']:.2f} s on average "
                f"({stalls} s), {row['stall_cost_at_30s']:.1%} of the 30 s between two saves** (paired within "
                "each run: the two logging windows after a save against the nearby windows without one).",
            ]
    repeats = result["repeats"]
    lines += ["", f"Runs interleaved, {repeats} of each. Targets: cost <= 2% on a 2-core CPU, <= 1% on an H100."]
    return lines


def _storage(result: dict) -> list[str]:
    slow = f"{result['slow_us_per_open'] / 1000:g} ms per open"
    lines = [
        "",
        f"### (f) Storage: a folder against shards, one loader worker (mode=loader, {result['repeats']} "
        f"interleaved rounds of {result['steps']} steps)",
        "",
    ]
    lines += [
        "| store | format | images/s per worker (median) | runs | data wait | read ms/image |",
        "| --- | --- | ---: | --- | ---: | ---: |",
    ]
    for row in result["rows"]:
        store = slow if row["store"] == "slow" else row["store"]
        runs = ", ".join(f"{v:,.0f}" for v in row["runs"]) or row.get("error", result["slow_store"])
        read = f"{row['read_ms_per_image']:.3f}" if row.get("read_ms_per_image") is not None else "—"
        lines.append(
            f"| {store} | {row['format']} | {_rate(row['images_per_sec_per_worker'])} | {runs} | "
            f"{_share(row['data_wait_frac'])} | {read} |"
        )
    lines.append("")
    for store, target in (("page cache", 0.95), ("slow", 3.0)):
        ratio = result["ratios"].get(store)
        name = slow if store == "slow" else store
        if not ratio:
            why = result["slow_store"] if store == "slow" and result["slow_store"] != "measured" else "the runs failed"
            lines.append(f"- {name}: not measured ({why})")
            continue
        verdict = "met" if ratio["min"] >= target else ("met by the median" if ratio["median"] >= target else "missed")
        lines.append(
            f"- {name}: shards/folder {ratio['median']:.2f}x (rounds {ratio['min']:.2f}-{ratio['max']:.2f}); "
            f"target >= {target:g}x: {verdict}"
        )
    return lines
