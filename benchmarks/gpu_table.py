"""gpu-check's table: each row against its target, and the Markdown that BENCHMARKS.md takes as it is."""

from __future__ import annotations

from gpu_rows import Target  # benchmarks/gpu_rows.py
from photos import summary as folder_summary  # benchmarks/photos.py


def judge(target: Target, entry: dict, done: list[dict]) -> dict:
    """The row's shares of the rows it is measured against (`done`: the rows before it) and whether it meets its
    target: True, False, or None (unknown: a figure it needs was not measured)."""
    rates = {row["key"]: row.get("images_per_sec") for row in done}
    rate = entry.get("images_per_sec")
    shares, verdicts = [], []
    for key, least in target.shares:
        other = rates.get(key)
        value = rate / other if rate and other else None
        shares.append({"of": key, "value": value, "least": least})
        verdicts.append(None if value is None else value >= least)
    if target.rate is not None:
        verdicts.append(None if not rate else rate >= target.rate)
    util = entry.get("gpu_util_mean")
    if target.util is not None:
        verdicts.append(None if util is None or not rate else util >= target.util)
    if target.util_of is not None:
        key, points = target.util_of
        other = next((row.get("gpu_util_mean") for row in done if row["key"] == key), None)
        verdicts.append(None if util is None or other is None or not rate else util >= other - points)
    met = False if False in verdicts else (None if None in verdicts or not verdicts else True)
    return {"target": target.text, "shares": shares, "met": met}


def _rate(entry: dict) -> str:
    """`2,465 / 2,720 (2,580-2,877)`: all steady steps' images over their time, then the median logging window with
    its 95% interval. Both: a run whose windows vary (stalls at epoch starts, a decode-bound stretch) has an overall
    rate below the median window's interval, and the interval belongs to the median, not to the overall figure."""
    rate, interval = entry.get("images_per_sec"), entry.get("images_per_sec_interval")
    if not rate:
        return entry.get("not_measured", "not measured")
    median = entry.get("images_per_sec_median")
    spread = f" ({interval[0]:,.0f}-{interval[1]:,.0f})" if interval else " (no interval)"
    return f"{rate:,.0f} / " + (f"{median:,.0f}" if median else "—") + spread


def _share(value: float | None) -> str:
    return f"{value:.1%}" if value is not None else "—"


def _memory(entry: dict) -> str:
    peak, used = entry.get("gpu_mem_peak_gb"), entry.get("gpu_mem_used_max_gb")
    if peak is None and used is None:
        return "—"
    return " / ".join(f"{v:.1f}" if v is not None else "—" for v in (peak, used)) + " GB"


def _result(entry: dict) -> str:
    if not entry.get("target") or not entry.get("images_per_sec"):
        return "—"
    if entry.get("met") is None:
        missing = [s["of"] for s in entry.get("shares", []) if s["value"] is None]
        return "unknown" + (f" ({', '.join(missing)} not measured)" if missing and entry.get("images_per_sec") else "")
    return "met" if entry["met"] else "not met"


def brief(entry: dict) -> str:
    """One line for the log."""
    if not entry.get("images_per_sec"):
        return entry.get("not_measured", "not measured")
    util = entry.get("gpu_util_mean")
    return (
        f"{_rate(entry)} img/s, data wait {_share(entry.get('data_wait_frac'))}, GPU util "
        f"{'n/a' if util is None else f'{util:.0f}%'}, memory {_memory(entry)}, {entry.get('measured_steps')} steps, "
        f"{entry.get('wall_s')} s; target: {_result(entry)}"
    )


def _loading(entry: dict) -> str:
    """`TorchCodec ...; JPEGs at 1/2-1/8 scale ... (simplejpeg 1.9.0); 13 workers, slices of 32`: the decoder and
    scale the row's run used (its metrics.json), its workers and their slices of a batch; the training thread's
    busy share."""
    parts = [entry["decoder"]] if entry.get("decoder") else []
    if entry.get("workers") is not None:
        slices = f", slices of {entry['worker_batch_size']}" if entry.get("worker_batch_size") else ""
        parts.append(f"{entry['workers']} workers{slices}")
    busy = entry.get("main_thread_busy_frac")
    if busy is not None:
        parts.append(f"training thread {busy:.0%} busy")
    return "; ".join(parts) or "—"


def row_line(entry: dict, quick: bool = False) -> str:
    shares = "; ".join(f"{_share(s['value'])} of {s['of']}" for s in entry.get("shares", [])) or "—"
    util = entry.get("gpu_util_mean")
    steps = f"{entry.get('measured_steps', '—')} of {entry['max_steps']} ({entry['log_every_n_steps']} a window)"
    what = entry["what"] + (f" ({entry['note']})" if entry.get("note") else "") + f": `{entry['command']}`"
    cells = [entry["key"], what, _rate(entry), _share(entry.get("data_wait_frac"))]
    cells += ["n/a" if util is None else f"{util:.0f}%", _memory(entry), _loading(entry), steps, shares]
    cells += [entry.get("target") or "—"]
    return "| " + " | ".join(cells + ["— (quick)" if quick else _result(entry)]) + " |"


def _header(report: dict) -> list[str]:
    m, env = report.get("machine", {}), report["sections"].get("env", {})
    lines = [f"## {report['date']} — gpu-check, GPU: {m.get('gpu') or 'none'}, commit {report['commit']}", ""]
    if report["quick"]:
        lines += ["(quick mode: rows scaled down, a smoke test, not figures to quote)", ""]
    state = "finished" if report.get("finished") else "in progress or cut (this file is rewritten after every part)"
    lines += [
        f"`{report['command']}`: deadline {report['deadline_s']:.0f} s, {report['elapsed_s']} s so far, {state}.",
        "",
    ]
    if m:
        lines.append(
            f"- Machine: {m.get('gpu') or 'no GPU'}, driver {m.get('driver') or '—'}, CUDA {m.get('cuda')}, "
            f"{m.get('cpu_count')} CPUs; Python {m.get('python')}, torch {m.get('torch')}, torchvision "
            f"{m.get('torchvision')}"
        )
        lines.append(f"- CPU decoder: {m.get('cpu_decoder')}")
    packages = env.get("packages", {})
    if packages:
        loads = [f"{name} {p.get('version')}" for name, p in packages.items() if p["loads"]]
        absent = [f"{name} ({p['why']})" for name, p in packages.items() if not p["loads"]]
        lines.append(f"- Packages: {', '.join(loads)}; not loading: {', '.join(absent) or 'none'}")
    checks = env.get("checks", [])
    lines.append(
        f"- Environment ({env.get('seconds', '—')} s, {env.get('status', 'not run')}): "
        + "; ".join(f"{'ok' if c['ok'] else 'FAILED'}: {c['check']}: {c['detail']}" for c in checks)
    )
    return lines


def _sections(report: dict) -> list[str]:
    tests = report["sections"].get("tests")
    lines = []
    if tests and tests["status"].startswith("not run"):
        lines.append(f"- GPU tests ({tests['selection']}): {tests['status']}")
    elif tests:
        failed = "; ".join(f"{name}: {why}" for name, why in tests.get("failed", {}).items()) or "none"
        lines.append(
            f"- GPU tests ({tests['selection']}, limit {tests['limit_s']} s): {tests['status']}: "
            f"{tests.get('passed', 0)} passed, failed: {failed}; {tests.get('skipped', 0)} skipped"
            + (f" ({'; '.join(tests['skip_reasons'])})" if tests.get("skip_reasons") else "")
            + (f"; {tests['seconds']} s" if "seconds" in tests else "")
            + (f"; not reached: {', '.join(tests['not_reached'])}" if tests.get("not_reached") else "")
            + (f"; not found (renamed?): {', '.join(tests['not_found'])}" if tests.get("not_found") else "")
        )
    data = report["sections"].get("data", {})
    if "result" in data:
        result = data["result"]
        lines.append(
            f"- Data: generated in {result['seconds']} s; the mixed JPEG folder: {folder_summary(result['photos'])}"
        )
    else:
        lines.append(f"- Data: {data.get('error') or data.get('status', 'not started')}")
    if report.get("pending"):
        lines.append(f"- Rows still to run when this was written: {', '.join(report['pending'])}")
    decoders = report["sections"].get("decoders")
    if decoders and decoders.get("table"):
        lines += ["", *decoders["table"], ""]
    elif decoders:
        lines.append(f"- Decoders: {decoders['status']}")
    profile = report["sections"].get("profile")
    if profile:
        where = " (runs.tar.gz: runs/profile/)" if profile["status"] == "ran" else ""
        lines.append(f"- Profile of the slowest JPEG row{' ' + profile['row'] if 'row' in profile else ''}: "
                     f"{profile['status']}{where}")  # fmt: skip
    return lines


def render(report: dict) -> str:
    """The Markdown section: the header, the parts' outcomes, then one table row per headline row."""
    lines = ["", *_header(report), *_sections(report), ""]
    lines += [
        "| key | what it runs | images/s: overall / median window (its 95% interval) | data wait | GPU util "
        "| peak GPU memory (torch / NVML) | decoder, workers | steps measured | share | target | result |",
        "| --- | --- | ---: | ---: | ---: | ---: | --- | --- | ---: | --- | --- |",
    ]
    lines += [row_line(entry, report["quick"]) for entry in report["rows"]]
    lines += [
        "",
        "Images/s: steady state after metrics.skip_first_steps: all steady steps' images over their time (what "
        "shares and targets use), then the median logging window and its 95% interval (metrics/spread.py), from "
        "each run's metrics.json; data wait: the share of step time the loop waited for "
        "a batch; GPU util: NVML's mean; memory: torch's peak allocation and NVML's device-wide peak. Each row's "
        "wall time and every figure are in gpu-check.json; its log and metrics.json in runs.tar.gz.",
        "",
    ]
    return "\n".join(lines)
