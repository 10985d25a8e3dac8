"""How a sweep's jobs are ranked: by the median of their steady-state window throughputs, with its 95% interval
(metrics/spread.py). A setting is named fastest only when its interval clears every other's *and* it is faster
by more than the sweep's resolution; the settings it cannot be told from are tied, and the cheapest of a tie is
recommended.

Why a resolution as well as intervals. A job's interval holds the noise of its own windows, not the noise
between jobs: on a shared 2-core machine two runs of one setting minutes apart differed by 4-19% (BENCHMARKS.md,
"sweep stability, second run"), so two jobs whose intervals do not overlap may still differ only by when they
ran. With repeats (repeat=0,1), the sweep measures that noise itself: the largest difference between two runs of
one setting. Without them it assumes `MIN_GAIN`, as asv assumes its `--factor` of 1.1 and criterion its noise
threshold: a smaller speed-up is not called one."""

from __future__ import annotations

import json
import math
import statistics
from typing import Any

from imgtrain.config.data import LoaderEngine
from imgtrain.metrics.spread import median_interval, overlaps
from imgtrain.sweep.plot import describe
from imgtrain.sweep.settings import no_effect, ran_alike, setting_of, written

# A job whose middle half of window throughputs spans more than this share of its median is marked noisy.
NOISY_SPREAD = 0.15
# Without repeats: the smallest speed-up called a difference (a ratio of medians of 1.10; repeats of one setting on
# a shared machine differ by about as much: BENCHMARKS.md, "sweep stability"). The sweep callback's `min_gain`
# overrides it.
MIN_GAIN = 0.10
# A tie's memory peaks (PSS) count as different only when apart by more than this, or by more than the most that
# repeats of one setting differed by, whichever is larger: the same setting's PSS moves by a few percent between
# runs (page cache, allocator), and that noise must not outrank what the sweep was about.
MEMORY_NOISE = 0.10
THREADS, DATALOADER = LoaderEngine.threads.value, LoaderEngine.dataloader.value
ENGINE_KEY = "data.engine"


def spread_of(metrics: dict[str, Any]) -> dict[str, Any]:
    """The median window rate and its 95% interval, in the units of images_per_sec (all ranks), recomputed from
    the windows so that runs written before metrics.json carried an interval are ranked the same way; and what
    makes a setting cheap (its engine, its workers, its pinned memory), all as the run used them. A finished run
    that recorded no engine ran worker processes, the only engine before data.engine; a job without figures: None."""
    windows = metrics.get("images_per_sec_windows") or []
    per_process, total = metrics.get("images_per_sec_per_process"), metrics.get("images_per_sec")
    ranks = total / per_process if total and per_process else 1.0
    interval = median_interval(windows)
    loader = metrics.get("loader") or {}
    return {
        "windows_all_ranks": [w * ranks for w in windows],
        "rate_median": statistics.median(windows) * ranks if windows else None,
        "interval_low": interval[0] * ranks if interval else None,
        "interval_high": interval[1] * ranks if interval else None,
        "interval_note": metrics.get("images_per_sec_interval_note") or ("" if interval else "too few windows"),
        "workers": loader.get("num_workers"),
        "pin": loader.get("pin_memory"),
        "prefetch": loader.get("prefetch_factor"),  # absent (None) without workers: nothing prefetched
        "persistent": loader.get("persistent_workers"),
        "engine": (loader.get("engine") or DATALOADER) if metrics else None,
        "loader": loader,  # the effective arguments: what the run used, whatever the override said
    }


def rank(rows: list[dict[str, Any]], min_gain: float = MIN_GAIN) -> dict[str, Any] | None:
    """Rank the finished jobs by their median window throughput and its 95% interval (metrics/spread.py) and
    return the one to recommend: the fastest when it is separated from every other (intervals apart and faster
    by more than the `resolution`), else the cheapest of the jobs tied with it (`cheapest`). Each row gets
    `standing` and a `confidence` note that says why; the one returned also gets `resolution` (its line)."""
    ok = [row for row in rows if row["status"] == "ok" and row["images_per_sec"]]
    if any(row["mode"] == "train" for row in ok):  # the ceiling modes are yardsticks, not settings to pick
        ok = [row for row in ok if row["mode"] == "train"]
    for row in rows:
        row["standing"], row["confidence"] = "", _noisy(row)
    repeats = pool_repeats(ok)  # the jobs of one setting (repeat=0,1,...) share its pooled figures
    ok = [group[0] for group in repeats.values()]  # one row stands for its setting
    measured = [row for row in ok if row["interval_low"] is not None]
    for row in ok:
        if row not in measured:
            row["standing"] = "not ranked"
            row["confidence"] = _join(f"not ranked: {row['interval_note']}", row["confidence"])
    if not measured:
        return None
    if len(measured) == 1:  # nothing measured to compare it with: not a "fastest"
        measured[0]["standing"] = "the only one ranked"
        return measured[0]
    leader = max(measured, key=lambda row: row["rate_median"])
    gain, why = resolution(repeats, min_gain)
    for row in measured:  # how much faster the leader is than each (the decision line quotes the smallest)
        row["gap"] = leader["rate_median"] / row["rate_median"] - 1 if row["rate_median"] else math.inf
    within = [row for row in measured if overlaps(_interval(row), _interval(leader)) or row["gap"] <= gain]
    # a setting that ran exactly as one of these did (data.pin_memory=true on a CPU) differs from it only by noise
    tied = [row for row in measured if any(row is other or ran_alike(row, other) for other in within)]
    noise = memory_noise(repeats)
    best = leader if len(tied) == 1 else cheapest(tied, noise)
    best["resolution"], best["memory_noise"] = why, noise
    for row in measured:
        if len(tied) == 1:
            row["standing"] = "fastest" if row is leader else "slower"
        else:
            row["standing"] = ("recommended: cheapest of a tie" if row is best else "tied") if row in tied else "slower"
        row["confidence"] = _join(_why(row, leader, tied), row["confidence"])
    for first, *others in repeats.values():
        for row in others:
            row["standing"], row["confidence"] = first["standing"], first["confidence"]
    return best


def resolution(repeats: dict[tuple, list[dict[str, Any]]], min_gain: float) -> tuple[float, str]:
    """The smallest relative difference this sweep can tell from noise, and a line that says where it comes from:
    with repeats, the largest difference between the job medians of one setting; else `min_gain`."""
    changes = [max(medians) / min(medians) - 1 for medians in _repeat_medians(repeats)]
    if changes:
        return max(changes), f"{max(changes):.1%}, the most two runs of one setting differed by in this sweep"
    return min_gain, (
        f"{min_gain:.0%}, assumed without repeats (hydra.callbacks.sweep_report.min_gain; "
        "repeat=0,1 measures it instead)"
    )


def _repeat_medians(groups: dict[tuple, list[dict[str, Any]]]) -> list[list[float]]:
    """For each setting run more than once: its runs' median window rates, in job (time) order."""
    runs = (
        [statistics.median(row["windows_all_ranks"]) for row in group if row.get("windows_all_ranks")]
        for group in groups.values()
    )
    return [medians for medians in runs if len(medians) > 1]


def _why(row: dict[str, Any], leader: dict[str, Any], tied: list[dict[str, Any]]) -> str:
    """The note that says why a ranked row stands where it does."""
    if row is leader:
        return "the highest median, not separated from the others of the tie" if len(tied) > 1 else ""
    twins = [other for other in tied if ran_alike(row, other)]
    if twins:
        jobs, keys = ", ".join(f"job {other['job']}" for other in twins), ", ".join(no_effect([row, *twins]))
        return f"tied: it ran with the same effective settings as {jobs} ({keys} had no effect here)"
    if row["standing"] == "slower":
        return f"slower: the leader is {row['gap']:.1%} faster and their intervals are apart"
    if overlaps(_interval(row), _interval(leader)):
        return "tied with the leader within noise (intervals overlap)"
    return f"tied with the leader within noise ({row['gap']:.1%} slower, within the sweep's resolution)"


def pool_repeats(rows: list[dict[str, Any]]) -> dict[tuple, list[dict[str, Any]]]:
    """Group rows by setting (in job order) and give the rows of a setting with several jobs the median and
    interval of all their windows together, and `repeats`: how many jobs ran it."""
    groups: dict[tuple, list[dict[str, Any]]] = {}
    for row in rows:
        groups.setdefault(setting_of(row), []).append(row)
    for group in groups.values():
        if len(group) == 1:
            continue
        pooled = [w for row in group for w in row.get("windows_all_ranks") or []]
        interval = median_interval(pooled)
        for row in group:
            row["repeats"] = len(group)
            row["rate_median"] = statistics.median(pooled) if pooled else None
            row["interval_low"], row["interval_high"] = interval if interval else (None, None)
    return groups


def drift(rows: list[dict[str, Any]]) -> str:
    """How much the machine's speed moved during the sweep, from the settings run more than once, against the
    smallest gap between settings; or how to measure it."""
    groups = pool_repeats([row for row in rows if row["status"] == "ok" and row.get("windows_all_ranks")])
    changes = [medians[-1] / medians[0] - 1 for medians in _repeat_medians(groups)]  # last run against first
    if not changes:
        return (
            "Drift not measured: run every setting twice, interleaved, by putting repeat=0,1 first "
            "(python train.py -m repeat=0,1 data.num_workers=...); the report pools the repeats."
        )
    moved = statistics.median(changes)
    medians = sorted(group[0]["rate_median"] for group in groups.values() if group[0]["rate_median"])
    gaps = [b / a - 1 for a, b in zip(medians, medians[1:], strict=False) if a]
    gap = f"the smallest gap between settings is {min(gaps):.1%}" if gaps else "one setting only"
    verdict = " (larger: the order in which jobs ran may decide the ranking)" if gaps and abs(moved) > min(gaps) else ""
    return f"Drift: a setting's last run against its first: {moved:+.1%} (median of {len(changes)}); {gap}{verdict}."


def cheapest(rows: list[dict[str, Any]], noise: float = MEMORY_NOISE) -> dict[str, Any]:
    """Of settings that run equally fast, the one that asks least of the machine. A memory peak (PSS) more than
    `noise` above the lowest rules a setting out: that is where loader threads are cheaper than worker processes,
    when they are, whichever engine the rest of the order would favour. Among the rest: pin_memory=false (no
    page-locked buffers), then the fewest workers (loader threads and worker processes counted alike), then the
    fewest prefetched batches, then no persistent workers (not applicable to threads: no processes are kept),
    then loader threads over worker processes (no processes to start, no /dev/shm), all as the run used them;
    then the same as written (of settings that ran alike, data.pin_memory=false over a true that a CPU ignored),
    then the lowest PSS. Settings that ran alike share their lowest peak: between them it is noise."""
    peaks = {id(row): _alike_peak(row, rows) for row in rows}
    known = [peak for peak in peaks.values() if peak]
    ceiling = min(known) * (1 + noise) if known else math.inf
    affordable = [row for row in rows if (peaks[id(row)] or 0.0) <= ceiling]

    def order(row: dict[str, Any]) -> tuple[tuple[float, ...], tuple[float, ...], float]:
        ran = _cost(*(row.get(field) for _, field in COST_FIELDS), row.get("engine"))
        # the engine as it ran in both: data.engine=threads with num_workers=0 ran the DataLoader, and a written
        # value that had no effect is no reason to prefer it (nor to avoid it)
        as_written = _cost(*(written(row, key, row.get(field)) for key, field in COST_FIELDS), row.get("engine"))
        return ran, as_written, row.get("pss_peak_gb") or math.inf

    return min(affordable, key=order)


# What `cheapest` weighs, in its order: the data.<key> and the row's field that holds the value the run used.
COST_FIELDS = (("pin_memory", "pin"), ("num_workers", "workers"), ("prefetch_factor", "prefetch"),
               ("persistent_workers", "persistent"))  # fmt: skip


def _cost(pin: Any, workers: Any, prefetch: Any, persistent: Any, engine: Any) -> tuple[float, ...]:
    workers = math.inf if workers is None else workers  # not known: the dearest
    prefetched = workers * (prefetch or 0) if workers else 0  # batches in flight
    threads = engine == THREADS
    # loader threads' pipeline lasting across epochs costs no processes: not a cost either way
    lasting = int(bool(persistent) and workers > 0 and not threads)
    return int(bool(pin)), workers, prefetched, lasting, int(not threads)


def _alike_peak(row: dict[str, Any], rows: list[dict[str, Any]]) -> float | None:
    """The row's memory peak, or the lowest of the rows that ran alike with it."""
    peaks = [other.get("pss_peak_gb") for other in rows if other is row or ran_alike(other, row)]
    return min((peak for peak in peaks if peak), default=None)


def memory_noise(repeats: dict[tuple, list[dict[str, Any]]]) -> float:
    """How far apart two memory peaks must be to differ: MEMORY_NOISE, or the most two runs of one setting's PSS
    differed by in this sweep (repeat=0,1), if larger."""
    spreads = [
        max(peaks) / min(peaks) - 1
        for peaks in ([row["pss_peak_gb"] for row in group if row.get("pss_peak_gb")] for group in repeats.values())
        if len(peaks) > 1
    ]
    return max([MEMORY_NOISE, *spreads])


def decision(rows: list[dict[str, Any]], swept: list[str], best: dict[str, Any] | None) -> str:
    """The report's answer in one line: the fastest setting when it is separated, else the tie and its cheapest."""
    if best is None:
        notes = [row["interval_note"] for row in rows if row.get("standing") == "not ranked" and row["interval_note"]]
        return "No job can be ranked: " + (notes[0] if notes else "none finished with a throughput figure") + "."
    low, high = best["interval_low"], best["interval_high"]
    runs = f", {best['repeats']} runs pooled" if best.get("repeats") else ""
    figure = f"{best['rate_median']:.1f} images/s (median window; 95% interval {low:.1f}-{high:.1f}{runs})"
    settings = {setting_of(row): row for row in reversed(rows)}.values()  # one row per setting, the first
    if best["standing"] == "the only one ranked":
        unranked = [row for row in settings if row.get("standing") == "not ranked"]
        why = f"; {len(unranked)} other(s) not ranked: {unranked[0]['interval_note']}" if unranked else ""
        return f"Nothing to compare: {describe(best, swept)} is the only setting ranked, at {figure}{why}."
    if best["standing"] == "fastest":
        others = [row for row in settings if row.get("standing") == "slower"]
        margin = f", clear of the {len(others)} other(s)" if others else ""
        gap = min(row["gap"] for row in others) if others else 0.0
        return (
            f"Fastest here: {describe(best, swept)} at {figure}{margin}, by {gap:.1%} or more; "
            f"the sweep's resolution is {best['resolution']}."
        )
    tied = sorted(
        (row for row in settings if row.get("standing", "").startswith(("tied", "recommended"))),
        key=lambda row: int(row["job"]) if str(row["job"]).isdigit() else 0,
    )
    names = ", ".join(describe(row, swept) for row in tied)
    alike = ", they ran with the same effective settings," if any(ran_alike(a, b) for a in tied for b in tied) else ","
    return (
        f"Tied within noise: {names} (their intervals overlap{alike} or they differ by less than the sweep's "
        f"resolution, {best['resolution']}). Recommended: {describe(best, swept)}, the cheapest of them "
        f"({cheapest_order(best.get('memory_noise', MEMORY_NOISE))}), "
        f"at {figure}.{no_effect_line(best, [row for row in tied if ran_alike(row, best)])}"
    )


def no_effect_line(best: dict[str, Any], alike: list[dict[str, Any]]) -> str:
    """When the recommended setting ran exactly as others of its tie did: which overrides had no effect, what the
    run used instead, and that the cheaper value as written is the one recommended ("" otherwise)."""
    if not alike:
        return ""
    group = sorted([best, *alike], key=lambda row: int(row["job"]) if str(row["job"]).isdigit() else 0)
    keys = no_effect(group)
    loader = best.get("loader") or {}
    used = ", ".join(f"{key.removeprefix('data.')}={json.dumps(loader.get(key.removeprefix('data.')))}" for key in keys)
    return (
        f" {', '.join(keys)} had no effect here: {' and '.join(describe(row, keys) for row in group)} ran with the "
        f"same effective settings ({used}), so the cheaper value as written is recommended."
    )


def cheapest_order(noise: float) -> str:
    """`cheapest`'s order, in words for the decision line."""
    return (
        f"pin_memory=false, then fewest workers (threads or processes alike), fewest prefetched batches, no "
        f"persistent workers, then threads over worker processes, among those whose memory peak is within "
        f"{noise:.0%} of the lowest"
    )


def _interval(row: dict[str, Any]) -> tuple[float, float]:
    return row["interval_low"], row["interval_high"]


def _noisy(row: dict[str, Any]) -> str:
    median, p25, p75 = row["images_per_sec_median"], row["images_per_sec_p25"], row["images_per_sec_p75"]
    if median and p25 is not None and (p75 - p25) / median > NOISY_SPREAD:
        return f"noisy: middle half of windows spans {(p75 - p25) / median:.0%} of the median"
    return ""


def _join(*notes: str) -> str:
    return "; ".join(note for note in notes if note)
