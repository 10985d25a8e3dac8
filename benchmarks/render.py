"""The markdown section bench.py appends to BENCHMARKS.md: one dated section per invocation."""

from __future__ import annotations

from pathlib import Path


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
    lines += _overhead(report["overhead"])
    lines += ["", "### (b) Modes per dataset (steady-state images/s)", ""]
    lines += [
        "| dataset | mode | images/s | data wait | GPU util | CPU % | RSS GB |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for row in report["modes"]:
        rate, wait = _rate(row.get("images_per_sec")), _share(row.get("data_wait_frac"))
        lines.append(
            f"| {row['dataset']} | {row['mode']} | {rate} | {wait} "
            f"| {_gpu(row.get('gpu_util_mean'))} | {_gpu(row.get('cpu_pct_mean')).rstrip('%')} "
            f"| {row.get('rss_peak_gb') or 0:.2f} |" + (f" error: {row['error']}" if "error" in row else "")
        )
    lines += ["", "### (c) Loader throughput by `data.num_workers` (mode=loader, shapes)", ""]
    lines += ["| num_workers | images/s | data wait |", "| ---: | ---: | ---: |"]
    for row in report["workers"]:
        lines.append(
            f"| {row['num_workers']} | {_rate(row.get('images_per_sec'))} | {_share(row.get('data_wait_frac'))} |"
        )
    lines += ["", "### (d) GPU targets", "", "| target | images/s | GPU util | note |", "| --- | ---: | ---: | --- |"]
    for row in report["gpu"]:
        note = row.get("note") or row.get("error") or f"`{row.get('command', '')}`"
        lines.append(
            f"| {row['target']} | {_rate(row.get('images_per_sec'))} | {_gpu(row.get('gpu_util_mean'))} | {note} |"
        )
    lines += [
        "",
        "Each row's command is in the JSON file. Images/s are steady state (after `trainer.warmup_steps`), summed "
        "over ranks; data wait is the share of step time the loop spent waiting for a batch.",
        "",
    ]
    return "\n".join(lines)


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
    return lines
