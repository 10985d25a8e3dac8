"""What a person reads: the verdict on what bounds a run, the end-of-run table, and the progress bar."""

from __future__ import annotations

import logging
import statistics
import sys
from typing import Any

from tqdm import tqdm

from imgtrain.config.fields import AUTO
from imgtrain.config.val_metrics import VAL_METRICS, field
from imgtrain.data.loader import auto_num_workers
from imgtrain.data.stages import WORKER_STAGES
from imgtrain.metrics.spread import MIN_WINDOWS, Rate, indistinguishable, windows_needed

# Above this share of step time spent waiting for data, the run is called input-bound.
INPUT_BOUND_WAIT = 0.10
EPOCH_START_NOTABLE = 0.03  # an epoch start costing more than this share of an epoch is named in the verdict


def suggest_next(summary: dict[str, Any]) -> str:
    """The next loader setting worth trying when a run is input-bound."""
    loader = summary["loader"]
    workers = loader["num_workers"]
    most = auto_num_workers(summary.get("local_world_size", summary["world_size"]), cpus=summary["cpu_count"])
    if workers < most:  # the same budget as num_workers=auto: this process's CPUs minus one for training
        return f"data.num_workers={min(max(1, 2 * workers), most)}"
    if summary["device"].startswith("cuda") and not loader["pin_memory"]:
        return "data.pin_memory=true"
    if workers and not loader.get("persistent_workers"):
        return "data.persistent_workers=true"
    if workers and (loader.get("prefetch_factor") or 2) < 4:
        return "data.prefetch_factor=4"
    return "fewer CPU cycles per image: pre-resized or smaller images, or decoding on the GPU"


# Training below this share of the model's own rate (measured alone), while workers keep CPUs busy: contention.
CONTENDED_RATE = 0.8
# Below this share of their time busy, the workers are idle: the loop waits for something else.
IDLE_WORKERS = 0.5
# What addresses each stage when it bounds a run (the verdict names the stage, then these).
STAGE_ADVICE = {
    "read": "local disk or the page cache (copy the dataset off network storage)",
    "decode": "dataset.decode=cuda (nvJPEG), more workers, or a faster decoder (pre-resized images)",
    "augment": "cheaper transforms, or augmenting on the GPU (data.device_resident=true for small datasets)",
    "collate": "fewer bytes per batch (smaller images) or larger, fewer batches",
    "transfer": "fewer bytes per batch (smaller images), larger batches, data.pin_memory=true",
    "gpu_decode": "pre-resized JPEGs (fewer pixels to decode), or dataset.decode=cpu with more workers",
    "idle": "a deeper prefetch (data.prefetch_factor=4) or less start-up (data.persistent_workers=true)",
}


# dataset.augment values whose crop, flip (and random erasing) can run on the device (data.augment_on=device)
DEVICE_POLICIES = ("none", "rrc_flip")


def stage_advice(stage: str, summary: dict[str, Any]) -> str:
    """What addresses `stage`. A read-bound run gets what fits where its data is: an image folder is packed into
    shards (one request per shard instead of one per image), shards in object storage are copied or cached; an
    augment-bound run what its policy allows (`augment_advice`)."""
    if stage == "augment":
        return augment_advice(summary)
    if stage != "read":
        return STAGE_ADVICE[stage]
    root = summary.get("dataset_root")
    if summary.get("dataset") != "shards":
        return (
            f"packing the folder into shards on local disk (one request per 64 MB shard instead of one per image): "
            f"`make shards SRC={root or '<image folder>'} DST=<local dir>`, then dataset=shards "
            f"dataset.root=<local dir>; and {STAGE_ADVICE['read']}"
        )
    if root and str(root).startswith("s3://"):
        return (
            f"a local copy of the shards (`aws s3 sync {root} <local dir>`, then dataset.root=<local dir>), or a "
            "dataset.cache_limit_gb above their size so each chunk is fetched once, not every epoch"
        )
    return STAGE_ADVICE["read"]


def augment_advice(summary: dict[str, Any]) -> str:
    """What takes the augment stage off the workers: on a GPU, the crop, flip and random erasing there (unless they
    are already), else a cheaper dataset.augment; the summary's `dataset_augment` names the policy (absent: both
    options, each with its condition)."""
    policy, loader = summary.get("dataset_augment"), summary.get("loader") or {}
    options, there = [], loader.get("augment_on") == "device" or loader.get("device_resident")
    if policy in (None, *DEVICE_POLICIES) and str(summary.get("device")).startswith("cuda") and not there:
        allowed = "" if policy else ", with dataset.augment=rrc_flip or none"
        options.append(f"augmenting on the GPU (data.augment_on=device{allowed})")
    if policy is None:
        options.append("a cheaper dataset.augment (rrc_flip: the crop and flip alone, batched)")
    elif policy not in DEVICE_POLICIES:
        options.append(f"a cheaper dataset.augment than {policy} (rrc_flip: the crop and flip alone, batched)")
    return ", or ".join(options) if options else STAGE_ADVICE["augment"]


def input_stage(pipeline: dict[str, Any] | None) -> str | None:
    """The stage that bounds an input-bound run: transfer, idle workers, or the costliest per-image stage."""
    if not pipeline or pipeline.get("worker_busy_frac") is None:
        return None
    if (pipeline.get("transfer_frac_of_wait") or 0.0) > 0.5:
        return "transfer"  # the batches were ready: the wait was moving them to the loop
    if pipeline["workers"] and pipeline["worker_busy_frac"] < IDLE_WORKERS:
        return "idle"
    per_image = pipeline["stage_ms_per_image"]
    costs = {stage: per_image[stage] for stage in (*WORKER_STAGES, "gpu_decode") if per_image.get(stage)}
    return max(costs, key=costs.get) if costs else None


def _stage_words(stage: str, pipeline: dict[str, Any]) -> str:
    if stage == "idle":
        return f"the workers are busy only {pipeline['worker_busy_frac']:.0%} of the time yet the loop waits"
    if stage == "transfer":
        return f"{pipeline['transfer_frac_of_wait']:.0%} of the wait comes after a worker finished the batch"
    per_image = pipeline["stage_ms_per_image"]
    total = sum(per_image.get(s) or 0.0 for s in (*WORKER_STAGES, "gpu_decode"))
    return f"{stage} takes the most input time ({per_image[stage]:.2f} of {total:.2f} ms per image)"


def contention(summary: dict[str, Any]) -> str | None:
    """Training far below the model's own rate, told apart from it by their intervals, while the workers keep
    the CPUs busy: name the stage that takes them."""
    pipeline = summary.get("pipeline") or {}
    training, own = training_rate(summary), model_rate(summary)
    if not training or not own or training.median >= CONTENDED_RATE * own.median or indistinguishable(training, own):
        return None
    if (pipeline.get("worker_busy_cores") or 0) < 0.25:
        return None
    per_image = pipeline["stage_ms_per_image"]
    stage = max((s for s in WORKER_STAGES if per_image.get(s)), key=lambda s: per_image[s], default="decode")
    fewer = f"data.num_workers={max(0, pipeline['workers'] - 1)}, " if pipeline["workers"] > 1 else ""
    return (
        f"CPU-contended: training ran at {training.median:.1f} images/s, {training.median / own.median:.0%} of the "
        f"model's own rate ({own.median:.1f} images/s with the workers idle), while loading kept "
        f"{pipeline['worker_busy_cores']:.1f} of {summary['cpu_count']} CPUs busy, most of it in {stage} "
        f"({per_image[stage]:.2f} ms per image); try {fewer}or take {stage} off these CPUs: "
        f"{stage_advice(stage, summary)}"
    )


def training_rate(summary: dict[str, Any]) -> Rate | None:
    """This process's training images/s: its median window with their interval (the overall figure without
    windows, from older metrics.json); None when not measured."""
    windows = summary.get("images_per_sec_windows") or []
    if windows:
        return Rate.of(windows)
    rate = summary.get("images_per_sec_per_process")
    return Rate(rate, None, 0) if rate else None


def model_rate(summary: dict[str, Any]) -> Rate | None:
    """The model's own images/s (tune probe or metrics.compute_probe) with its interval; None when not timed."""
    return Rate.read(summary.get("pipeline") or {}, "compute_images_per_sec")


def verdict(summary: dict[str, Any]) -> str:
    """Input-bound (naming the stage), CPU-contended, or compute-bound; and the epoch-start stall when notable."""
    wait = summary["data_wait_frac"]
    if summary["mode"] != "train" or wait is None:
        return ""
    return _bound(summary, wait) + epoch_start_note(summary)


def epoch_start_note(summary: dict[str, Any]) -> str:
    """`; each epoch start costs 0.36 s (5% of an epoch) ...` when it costs more than EPOCH_START_NOTABLE."""
    share, costs = summary.get("epoch_start_cost_frac"), summary.get("epoch_start_cost_s") or []
    if share is None or share <= EPOCH_START_NOTABLE:
        return ""
    loader = summary.get("loader") or {}
    remedy = ""
    if loader.get("num_workers") and not loader.get("persistent_workers"):
        remedy = ": set data.persistent_workers=true (workers are started again at every epoch)"
    return f"; each epoch start costs {statistics.median(costs):.2f} s ({share:.0%} of an epoch){remedy}"


def epoch_start_line(summary: dict[str, Any]) -> str:
    """The console's epoch-start row: the first batch's wait and the stall after it."""
    first, costs = summary.get("epoch_first_batch_s") or [], summary.get("epoch_start_cost_s") or []
    if not first:
        return "n/a"
    text = f"first batch after {statistics.median(first):.3f} s (median of {len(first)} epoch(s))"
    if not costs:
        return f"{text}; one epoch: no later epoch start to measure"
    share = summary.get("epoch_start_cost_frac")
    of_epoch = f" ({share:.1%} of an epoch)" if share is not None else ""
    return f"{text}; each later start costs {statistics.median(costs):.3f} s{of_epoch}"


def _bound(summary: dict[str, Any], wait: float) -> str:
    pipeline = summary.get("pipeline")
    if wait > INPUT_BOUND_WAIT:
        stage = input_stage(pipeline)
        if stage is None:
            return f"input-bound: {wait:.0%} of step time waits for data; try {suggest_next(summary)}"
        more = suggest_next(summary) if stage in ("read", "decode", "augment") else None
        advice = stage_advice(stage, summary)
        advice = advice if more is None or "num_workers" not in more else f"{more}, {advice}"
        return f"input-bound: {wait:.0%} of step time waits for data; {_stage_words(stage, pipeline)}: try {advice}"
    contended = contention(summary)
    if contended:
        return contended
    own = _own_rate(summary)
    return f"compute-bound: only {wait:.0%} of step time waits for data; more loader workers will not help{own}"


def _own_rate(summary: dict[str, Any]) -> str:
    """`(training ran at 73% of the model's own 140.8 images/s ...)`, when the model's own rate was measured and
    is told apart from training's; else that the two are indistinguishable. Never a ratio above 100%."""
    training, own = training_rate(summary), model_rate(summary)
    if not training or not own:
        return ""
    figures = f"{training.median:.1f} against {own.median:.1f} images/s"
    if training.median >= own.median or indistinguishable(training, own):
        return f" (training and the model alone are indistinguishable: {figures}, within their noise)"
    spread = f", 95% interval {own.interval[0]:.1f}-{own.interval[1]:.1f}" if own.interval else ""
    return f" (training ran at {training.median / own.median:.0%} of the model's own {own.median:.1f} images/s{spread})"


def why_not_measured(steps_run: int, warmup_steps: int, profiled_steps: int = 0) -> str:
    """Why a run has no throughput figure, and how to get one. `warmup_steps` counts the `profiled_steps`."""
    if steps_run <= warmup_steps:
        skipped = f"metrics.skip_first_steps={warmup_steps - profiled_steps}"
        if profiled_steps:
            skipped += f", then {profiled_steps} profiled steps (metrics.profile=true)"
        return (
            f"not measured: all {steps_run} steps of this run were warm-up steps ({skipped}), which throughput "
            "leaves out; run more steps (train.max_steps) or lower metrics.skip_first_steps"
        )
    return f"not measured: no steady-state window closed in this run's {steps_run} steps"


def too_few_windows(windows: int, skip_first_steps: int, log_every_n_steps: int) -> str:
    """Why a run's throughput has no interval, and the run length that would give one."""
    enough = windows_needed(skip_first_steps, log_every_n_steps)
    return (
        f"no interval: {windows} steady-state window(s), {MIN_WINDOWS} needed to bound the median; run at "
        f"least {enough} steps (train.max_steps, train.epochs) or lower metrics.log_every_n_steps"
    )


def rate_line(summary: dict[str, Any]) -> str:
    """`767.1 over all steady steps; median window 780.4 (95% interval of the median window 740.2-790.0, 12
    windows)`, or why there is no figure. Both figures: when windows vary (epoch-start stalls, a decode-bound
    stretch) the overall rate falls below the median window's interval, which belongs to the median alone."""
    if summary.get("images_per_sec_note"):
        return summary["images_per_sec_note"]
    rate, interval = _fmt(summary["images_per_sec"], ",.1f"), summary.get("images_per_sec_interval")
    if not interval:
        return f"{rate} ({summary.get('images_per_sec_interval_note') or 'no interval'})"
    windows = len(summary.get("images_per_sec_windows") or [])
    median, own = summary.get("images_per_sec_median"), summary.get("images_per_sec_per_process")
    # the median is this process's; the interval, like images_per_sec, is scaled to all ranks
    scaled = median * summary["images_per_sec"] / own if median and own else None
    return (
        f"{rate} over all steady steps; median window {_fmt(scaled, ',.1f')} (95% interval of the median window "
        f"{interval[0]:,.1f}-{interval[1]:,.1f}, {windows} windows)"
    )


def _fmt(value: Any, spec: str) -> str:
    return "n/a" if value is None else format(value, spec)


def print_table(summary: dict[str, Any]) -> None:
    """A short summary on the console."""
    loader = summary["loader"]
    rows = [
        ("images/s (steady state)", rate_line(summary)),
        ("data wait (share of step)", _fmt(summary["data_wait_frac"], ".1%")),
        ("epoch start", epoch_start_line(summary)),
        ("step time (ms)", _fmt(summary["step_time_ms"], ".1f")),
        ("verdict", summary.get("verdict") or "n/a"),
        ("input stages (ms per image)", stages_line(summary.get("pipeline"))),
        ("loading busy", busy_line(summary.get("pipeline"), loader.get("engine"))),
        ("GPU util (mean %)", _fmt(summary["gpu_util_mean"], ".1f")),
        ("CPU (mean % of system)", _fmt(summary["cpu_pct_mean"], ".1f")),
        ("RSS peak incl. workers (GB)", _fmt(summary["rss_peak_gb"], ".2f")),
        ("PSS peak incl. workers (GB)", _fmt(summary.get("pss_peak_gb"), ".2f")),
        *val_rows(summary),
        ("steps / wall time (s)", f"{summary['steps']} / {summary['wall_time_s']:.1f}"),
        (
            "loader",
            f"batch_size={loader['batch_size']} num_workers={loader['num_workers']} pin_memory={loader['pin_memory']}"
            + (" engine=threads" if loader.get("engine") == "threads" else ""),
        ),
        (
            "device / precision / world",
            f"{summary['device']} / {summary['precision']} / {summary['world_size']}",
        ),
    ]
    width = max(len(name) for name, _ in rows)
    lines = [f"  {name.ljust(width)}  {value}" for name, value in rows]
    print("\n".join(["", "Run summary", *lines, ""]), flush=True)


def val_rows(summary: dict[str, Any]) -> list[tuple[str, str]]:
    """A row per figure validation computes (config/val_metrics.py), the EMA's beside the model's when there is one."""
    rows = []
    for metric in VAL_METRICS:
        value, ema = _fmt(summary.get(field(metric)), ".4f"), summary.get(field(metric, ema=True))
        rows.append((metric.label, value if ema is None else f"{value} (EMA {ema:.4f})"))
    return rows


def stages_line(pipeline: dict[str, Any] | None) -> str:
    """`read 0.05  decode 0.40 ...`: each measured stage's milliseconds per image, workers' stages first."""
    per_image = (pipeline or {}).get("stage_ms_per_image") or {}
    shown = [f"{stage} {value:.3f}" for stage, value in per_image.items() if value is not None]
    return "  ".join(shown) if shown else "n/a (no timed batches: data.stage_timings=false or no DataLoader)"


def busy_line(pipeline: dict[str, Any] | None, engine: str | None = None) -> str:
    """How busy the loading processes (or threads, data.engine=threads) were: busy time over wall time x workers."""
    if not pipeline or pipeline.get("worker_busy_frac") is None:
        return "n/a"
    workers = pipeline["workers"]
    kind = "loader thread(s)" if engine == "threads" else "worker(s)"
    who = f"{workers} {kind}" if workers else "the training process (num_workers=0)"
    return f"{pipeline['worker_busy_frac']:.0%} of {who}, {pipeline['worker_busy_cores']:.2f} CPU cores"


def bounding_stage(summary: dict[str, Any]) -> str | None:
    """The input stage named by the verdict of an input-bound run (None otherwise)."""
    wait = summary.get("data_wait_frac")
    return input_stage(summary.get("pipeline")) if wait is not None and wait > INPUT_BOUND_WAIT else None


def progress_bar(total: int, epoch: int, setting: Any) -> tqdm:
    """A per-epoch bar with img/s; on by default only on a terminal, so logs in files stay readable."""
    show = sys.stderr.isatty() if setting == AUTO else bool(setting)
    return tqdm(total=total, desc=f"epoch {epoch + 1}", unit="step", disable=not show, dynamic_ncols=True, leave=False)


def update_progress(bar: tqdm, metrics: dict[str, float], global_step: int) -> None:
    """Show the latest window's figures on the bar (or as a log line when there is no bar)."""
    shown = {"loss": f"{metrics['train/loss']:.3f}"} if "train/loss" in metrics else {}
    if "perf/images_per_sec" in metrics:
        shown["img/s"] = f"{metrics['perf/images_per_sec']:.0f}"
        shown["wait"] = f"{metrics['perf/data_wait_frac']:.0%}"
    if bar.disable:
        logging.getLogger("imgtrain.train.run").info(
            "step %d: %s", global_step, " ".join(f"{k} {v}" for k, v in shown.items())
        )
    else:
        bar.set_postfix(shown, refresh=False)
