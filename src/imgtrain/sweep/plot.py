"""The sweep report's picture: throughput with the fastest job and the ceilings, data wait, and stage times per job.

What to draw is computed by pure functions on the report's rows (`series`, `ceiling_lines`, `stage_bars`), so
any mix of rows (failed jobs, jobs without figures, older metrics.json without `pipeline`) gives a picture.
"""

from __future__ import annotations

import io
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

from imgtrain.data.stages import STAGES, WORKER_STAGES  # metrics.json's `pipeline.stage_ms_per_image`, in order
from imgtrain.sweep.files import write_file

if TYPE_CHECKING:
    from matplotlib.figure import Figure

STAGE_CAPTION = (
    "read, decode, augment, collate: time in the workers (wall clock), summed over workers, per image;\n"
    "transfer, h2d, gpu_decode: time in the training process, per image"
)


def describe(row: dict[str, Any], keys: list[str]) -> str:
    """The row's values of `keys`, as `key=value` pairs."""
    return " ".join(f"{k}={row['overrides'].get(k, '')}" for k in keys)


def as_number(value: Any) -> float | None:
    """The value as a float, None when it is not a number."""
    try:
        return float(value)
    except (TypeError, ValueError, OverflowError):  # OverflowError: an integer too large for a float
        return None


def rate(row: dict[str, Any]) -> float | None:
    """The plotted throughput: the median window (of all of a setting's runs when it was repeated, in the units
    of images_per_sec), else the job's own median, else the overall figure (None: not measured)."""
    return row.get("rate_median") or row.get("images_per_sec_median") or row.get("images_per_sec")


def _plotted(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [row for row in rows if row["status"] == "ok" and rate(row)]  # n/a: not plotted


def x_values(rows: list[dict[str, Any]], x_key: str) -> dict[str, Any]:
    """Each plotted job's x: numbers when every job's value is one (one axis cannot mix), else the text."""
    raw = {row["job"]: row["overrides"].get(x_key, row["job"]) for row in _plotted(rows)}
    numeric = all(as_number(x) is not None for x in raw.values())
    return {job: as_number(x) if numeric else str(x) for job, x in raw.items()}


def series(rows: list[dict[str, Any]], swept: list[str]) -> dict[str, list[dict[str, Any]]]:
    """Plotted jobs grouped by the swept keys after the first (one line each), sorted along the x axis."""
    x_key, series_keys = (swept[0], swept[1:]) if swept else ("job", [])
    xs = x_values(rows, x_key)
    groups: dict[str, list[dict[str, Any]]] = {}
    for row in _plotted(rows):
        groups.setdefault(describe(row, series_keys) or "all jobs", []).append(row)
    if all(isinstance(x, float) for x in xs.values()):
        groups = {label: sorted(members, key=lambda row: xs[row["job"]]) for label, members in groups.items()}
    return groups


def _dict(value: Any) -> dict[str, Any]:
    return value if isinstance(value, dict) else {}


class Ceiling(NamedTuple):
    """A ceiling drawn on the throughput panel: its kind, figure (images/s), legend label and 95% interval."""

    kind: str
    figure: float
    label: str
    band: tuple[float, float] | None


def _interval(value: Any) -> tuple[float, float] | None:
    pair = value if isinstance(value, list | tuple) and len(value) == 2 else None
    bounds = [as_number(v) for v in pair] if pair else []
    return (bounds[0], bounds[1]) if len(bounds) == 2 and None not in bounds else None


def _best_of(values: list[tuple[Any, Any]]) -> tuple[float, tuple[float, float] | None, int] | None:
    """The highest figure of (figure, interval) pairs, with its interval, and how many there were."""
    numbers = [(v, _interval(band)) for v, band in ((as_number(value), band) for value, band in values) if v]
    if not numbers:
        return None
    figure, band = max(numbers, key=lambda pair: pair[0])
    return figure, band, len(numbers)


def _best_loader_setting(tune: dict[str, Any]) -> tuple[Any, Any]:
    table = tune.get("table") if isinstance(tune.get("table"), list) else []
    entries = [(_dict(e).get("images_per_sec"), _dict(e).get("images_per_sec_interval")) for e in table]
    best = _best_of(entries)
    return (best[0], best[1]) if best else (None, None)


def ceiling_lines(rows: list[dict[str, Any]]) -> list[Ceiling]:
    """Each ceiling the sweep measured, with its interval where it has one: mode=loader / mode=compute jobs, the
    jobs' `tune` probes (best loader setting tried, compute alone) and `pipeline.compute_images_per_sec`; the
    best of jobs."""
    ok = [row for row in rows if row["status"] == "ok"]
    tunes = [_dict(row.get("tune")) for row in ok]
    pipelines = [_dict(row.get("pipeline")) for row in ok]

    def jobs(mode: str) -> list[tuple[Any, Any]]:
        return [(rate(row), (row.get("interval_low"), row.get("interval_high"))) for row in ok if row["mode"] == mode]

    def model(records: list[dict[str, Any]]) -> list[tuple[Any, Any]]:
        return [(r.get("compute_images_per_sec"), r.get("compute_images_per_sec_interval")) for r in records]

    sources = [
        ("loader", "mode=loader", jobs("loader")),
        ("compute", "mode=compute", jobs("compute")),
        ("loader", "tune probe", [_best_loader_setting(tune) for tune in tunes]),
        ("compute", "tune probe", model(tunes)),
        ("compute", "measured in the run", model(pipelines)),
    ]
    lines = []
    for kind, source, values in sources:
        best = _best_of(values)
        if best is not None:
            figure, band, count = best
            of = f", best of {count} jobs" if count > 1 else ""
            spread = f", 95% interval {band[0]:.1f}-{band[1]:.1f}" if band else ", no interval"
            lines.append(Ceiling(kind, figure, f"{kind} ceiling ({source}{of}): {figure:.1f} images/s{spread}", band))
    return lines


def stage_label(row: dict[str, Any], swept: list[str]) -> str:
    """A short x label for one job: its number and swept values, the keys without their group."""
    values = [f"{k.rsplit('.', 1)[-1]}={row['overrides'].get(k, '')}" for k in swept]
    return "\n".join([f"job {row['job']}", *values])


def stage_bars(rows: list[dict[str, Any]], swept: list[str]) -> tuple[list[str], dict[str, list[float]]]:
    """Job labels and, for every stage measured in any job, its ms per image in each job (missing: 0).
    Only jobs with stage times are drawn; no labels when none has them (older metrics.json, failed jobs)."""
    timed = []
    for row in rows:
        stages = _dict(_dict(row.get("pipeline")).get("stage_ms_per_image"))
        values = {stage: as_number(stages.get(stage)) for stage in STAGES}
        if row["status"] == "ok" and any(v is not None for v in values.values()):
            timed.append((row, values))
    measured = [stage for stage in STAGES if any(values[stage] is not None for _, values in timed)]
    heights = {stage: [values[stage] or 0.0 for _, values in timed] for stage in measured}
    return [stage_label(row, swept) for row, _ in timed], heights


def error_bars(row: dict[str, Any]) -> tuple[float, float] | None:
    """(below, above) the plotted median: its 95% interval (sweep/rank.py), None when the job has too few windows.
    Clamped at 0: the interval comes from metrics.json's windows, rounded to 0.01 img/s, the median from the
    unrounded ones, and matplotlib refuses a negative bar."""
    r, low, high = rate(row), row.get("interval_low"), row.get("interval_high")
    if r is None or low is None or high is None:
        return None
    return max(0.0, r - low), max(0.0, high - r)


def _draw_series(ax_rate: Any, ax_wait: Any, rows: list[dict[str, Any]], swept: list[str]) -> None:
    xs = x_values(rows, swept[0] if swept else "job")
    unranked = False
    for label, members in series(rows, swept).items():
        x, rates = [xs[row["job"]] for row in members], [rate(row) for row in members]
        (line,) = ax_rate.plot(x, rates, marker="o", label=label)
        for row in members:
            bars = error_bars(row)
            if bars is None:  # too few windows for an interval: a hollow point, not ranked
                ax_rate.plot([xs[row["job"]]], [rate(row)], marker="o", markerfacecolor="white", color=line.get_color())
                unranked = True
            else:
                ax_rate.errorbar([xs[row["job"]]], [rate(row)], yerr=[[bars[0]], [bars[1]]], capsize=3,
                                 color=line.get_color(), linestyle="none")  # fmt: skip
        ax_wait.plot(x, [100 * (row["data_wait_frac"] or 0) for row in members], marker="o", label=label)
    if unranked:
        ax_rate.plot([], [], marker="o", markerfacecolor="white", color="gray", linestyle="none",
                     label="hollow: too few windows for an interval, not ranked")  # fmt: skip
    if xs and all(isinstance(x, float) for x in xs.values()):
        for ax in (ax_rate, ax_wait):
            ax.set_xticks(sorted(set(xs.values())))


def _axis_order(rows: list[dict[str, Any]], swept: list[str]) -> list[Any]:
    """The distinct x values as the axis shows them, left to right."""
    values = list(dict.fromkeys(x_values(rows, swept[0] if swept else "job").values()))  # in drawing order
    return sorted(values) if all(isinstance(v, float) for v in values) else values


def _starred_at_right_end(rows: list[dict[str, Any]], swept: list[str], best: dict[str, Any] | None) -> bool:
    """Whether the starred job's label hangs at the right end of the axis (`_draw_fastest`)."""
    xs, order = x_values(rows, swept[0] if swept else "job"), _axis_order(rows, swept)
    return best is not None and best["job"] in xs and len(order) > 1 and xs[best["job"]] == order[-1]


def _draw_fastest(ax: Any, rows: list[dict[str, Any]], swept: list[str], best: dict[str, Any]) -> None:
    x = x_values(rows, swept[0] if swept else "job")[best["job"]]
    y = rate(best)
    ax.plot(
        [x],
        [y],
        marker="*",
        markersize=18,
        color="gold",
        markeredgecolor="black",
        linestyle="none",
        zorder=5,
        gid="fastest",
    )
    titles = {"fastest": "fastest", "the only one ranked": "the only one ranked"}
    title = titles.get(best.get("standing", ""), "recommended\n(cheapest of a tie)")
    text = f"job {best['job']}: {title}\n{y:.1f} images/s (median window)"
    xs = _axis_order(rows, swept)
    # at either end of the axis the label hangs inward, not over the axis label
    align = "left" if x == xs[0] and len(xs) > 1 else "right" if x == xs[-1] and len(xs) > 1 else "center"
    ax.annotate(
        text,
        xy=(ax.xaxis.convert_units(x), y),
        xytext=(0, 14),
        textcoords="offset points",
        ha=align,
        fontsize=8,
        fontweight="bold",
        bbox={"boxstyle": "round,pad=0.2", "facecolor": "white", "edgecolor": "none", "alpha": 0.85},
        zorder=6,  # over the ceiling lines and their figures (the legend still names each ceiling)
    )


CEILING_COLORS = ("tab:red", "tab:purple", "tab:brown", "tab:pink", "tab:olive")


def _draw_ceilings(ax: Any, rows: list[dict[str, Any]], left_first: bool) -> None:
    """Each ceiling as a line (and its interval as a band), its figure written at the right end of the axis, or
    the left when `left_first` (the starred job's label hangs at the right)."""
    lines = sorted(ceiling_lines(rows), key=lambda line: line.figure)
    ys = [rate(row) or 0.0 for row in _plotted(rows)] + [line.figure for line in lines]
    close = 0.06 * (max(ys) - min(ys)) if ys else 0.0  # labels nearer than this (images/s) would overlap
    ends = (0.01, 0.99) if left_first else (0.99, 0.01)
    last = dict.fromkeys(ends, -float("inf"))  # the last figure written at each end, in the order tried
    for (kind, figure, label, band), color in zip(lines, CEILING_COLORS, strict=False):
        top = band[1] if band else figure
        above = [row["job"] for row in _plotted(rows) if row["mode"] == "train" and (rate(row) or 0) > figure]
        if above:  # a ceiling is a short measurement, not a bound: say whether a job above it clears its noise
            beyond = any((rate(row) or 0) > top for row in _plotted(rows) if row["job"] in above)
            why = "above its interval too: the probe ran slower than training did" if beyond else "within its interval"
            label += f"; job {', '.join(above)} above it, {why if band else 'one short probe without an interval'}"
        ax.axhline(figure, color=color, linestyle="--" if kind == "loader" else ":", label=label, gid="ceiling")
        if band:
            ax.axhspan(*band, color=color, alpha=0.12, linewidth=0, gid="ceiling band")
        side = next((x for x, below in last.items() if figure - below > close), None)
        if side is not None:  # else no room: the legend still gives the figure
            last[side] = figure
            # x in axes fractions, y in images/s: the figure sits on its line, at the right end or the left
            ax.text(side, figure, f"{figure:.1f}", transform=ax.get_yaxis_transform(),
                    ha="right" if side > 0.5 else "left", va="bottom", fontsize=7, color=color)  # fmt: skip


def _draw_stages(ax: Any, labels: list[str], heights: dict[str, list[float]]) -> None:
    bottom = [0.0] * len(labels)
    for stage, values in heights.items():
        ax.bar(range(len(labels)), values, bottom=bottom, label=stage, hatch="" if stage in WORKER_STAGES else "//")
        bottom = [b + v for b, v in zip(bottom, values, strict=True)]
    ax.set_xticks(range(len(labels)), labels, fontsize=7)
    ax.set_ylabel("ms per image")
    ax.set_title(f"Input pipeline: time per image by stage\n{STAGE_CAPTION}", fontsize=9)
    ax.set_ylim(0, 1.25 * max(bottom) if max(bottom) > 0 else 1.0)  # room for the legend above the tallest bar
    ax.legend(fontsize=8, ncol=len(heights), loc="upper center")


def plot(path: Path | None, rows: list[dict[str, Any]], swept: list[str], best: dict[str, Any] | None = None) -> Figure:
    """Throughput (median, middle half of windows, the fastest job starred, the ceilings as lines) and data wait
    against the first swept key; below them, stacked stage times per job when any job measured them. Saved to
    `path` (None: only drawn, for a look at what was drawn)."""
    # Imported here: every run loads this module through the Hydra callback, only a multirun's end draws.
    import matplotlib

    matplotlib.use("Agg")  # no display needed
    import matplotlib.pyplot as plt

    labels, heights = stage_bars(rows, swept)
    if labels:
        fig, axes = plt.subplot_mosaic([["rate", "wait"], ["stages", "stages"]], figsize=(12, 8.6))
        ax_rate, ax_wait = axes["rate"], axes["wait"]
        _draw_stages(axes["stages"], labels, heights)
    else:
        fig, (ax_rate, ax_wait) = plt.subplots(1, 2, figsize=(12, 4.4))
    _draw_series(ax_rate, ax_wait, rows, swept)
    _draw_ceilings(ax_rate, rows, left_first=_starred_at_right_end(rows, swept, best))
    if best is not None and rate(best):
        _draw_fastest(ax_rate, rows, swept, best)
    x_key = swept[0] if swept else "job"
    ax_rate.set(xlabel=x_key, ylabel="images/s (median window, 95% interval)", title="Throughput")
    ax_wait.set(xlabel=x_key, ylabel="% of step time waiting for data", title="Data wait")
    for ax in (ax_rate, ax_wait):
        ax.set_ylim(bottom=0)  # from zero: a 14% difference must not look like a cliff
    ax_rate.set_ylim(top=1.2 * ax_rate.get_ylim()[1])  # room above the top point or ceiling for the star's label
    several = len(series(rows, swept)) > 1
    for ax in (ax_rate, ax_wait):
        ax.grid(alpha=0.3)
        if several or (ax is ax_rate and (ceiling_lines(rows) or ax.get_legend_handles_labels()[0])):
            ax.legend(fontsize=7, loc="lower right" if ax is ax_rate else "best")  # throughput: empty below
    if path is not None:
        fig.tight_layout()
        image = io.BytesIO()  # written whole, never through a link another user planted (sweep/files.py)
        fig.savefig(image, format="png", dpi=110)
        write_file(path, image.getvalue())
    plt.close(fig)  # the Figure stays readable (tests inspect what was drawn); pyplot forgets it
    return fig
