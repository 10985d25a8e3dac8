"""measure.py's summary: per setting (dataset, policy, workers) and engine, the median of each figure over the
rounds with its min-max spread, and each engine's images/s over the DataLoader's taken round by round (the two ran
back to back in the same round, so the machine's other load hits both)."""

from __future__ import annotations

import statistics
from typing import Any

FIGURES = (  # (key in a run, column header, format)
    ("images_per_sec", "images/s", ",.0f"),
    ("first_batch_s", "first batch s", ".2f"),
    ("stall_s", "epoch-start stall s", ".3f"),
    ("peak_pss_mib", "peak PSS MiB", ",.0f"),
)
BASELINE = "dataloader"


def spread(values: list[float]) -> dict[str, Any] | None:
    """Median, min, max and the values themselves (None when no run gave one)."""
    values = [v for v in values if v is not None]
    if not values:
        return None
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "runs": values}


def figure(run: dict[str, Any], key: str) -> float | None:
    """One run's figure; the stall is the median over its epochs after the first."""
    value = run.get(key)
    if key == "stall_s":
        return statistics.median(value) if value else None
    return value


def setting_of(run: dict[str, Any]) -> tuple[str, str, int]:
    return run["dataset"], run["policy"], run["workers"]


def summarize(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per (setting, engine), in the order first met: each figure's spread, the ratio to the baseline's
    images/s per round, and whether the engine's first batches had the baseline's pixels (the digest)."""
    rows: dict[tuple[Any, ...], dict[str, Any]] = {}
    for run in runs:
        key = (*setting_of(run), run["engine"])
        rows.setdefault(key, {"setting": setting_of(run), "engine": run["engine"], "runs": []})["runs"].append(run)
    out = []
    for (dataset, policy, workers, engine), row in rows.items():
        done = [r for r in row["runs"] if "error" not in r]
        base = {r["round"]: r for r in rows.get((dataset, policy, workers, BASELINE), {"runs": []})["runs"]}
        ratios = [
            r["images_per_sec"] / base[r["round"]]["images_per_sec"]
            for r in done
            if r["round"] in base and r.get("images_per_sec") and base[r["round"]].get("images_per_sec")
        ]
        digests = {tuple(r.get("digest") or ()) for r in done} | {tuple(b.get("digest") or ()) for b in base.values()}
        out.append(
            {
                "dataset": dataset,
                "policy": policy,
                "workers": workers,
                "engine": engine,
                "runs": len(row["runs"]),
                "errors": [r["error"] for r in row["runs"] if "error" in r],
                **{key: spread([figure(r, key) for r in done]) for key, _, _ in FIGURES},
                "x_dataloader": spread(ratios),
                "same_pixels_as_dataloader": len(digests) == 1 if done and base else None,
            }
        )
    return out


def cell(value: dict[str, Any] | None, fmt: str) -> str:
    if value is None:
        return "n/a"
    return f"{value['median']:{fmt}} ({value['min']:{fmt}}-{value['max']:{fmt}})"


def table(rows: list[dict[str, Any]]) -> list[str]:
    """A markdown table: medians with their min-max spread."""
    headers = ["dataset", "policy", "N", "engine", *(h for _, h, _ in FIGURES), "x DataLoader", "same pixels"]
    lines = ["| " + " | ".join(headers) + " |", "|" + " --- |" * len(headers)]
    for row in rows:
        cells = [row["dataset"], row["policy"], str(row["workers"]), row["engine"]]
        cells += [cell(row[key], fmt) for key, _, fmt in FIGURES]
        same = {True: "yes", False: "NO", None: "n/a"}[row["same_pixels_as_dataloader"]]
        cells += [cell(row["x_dataloader"], ".2f"), same]
        if row["errors"]:
            cells[-1] += f" ({len(row['errors'])} failed: {row['errors'][0][:80]})"
        lines.append("| " + " | ".join(cells) + " |")
    return lines
