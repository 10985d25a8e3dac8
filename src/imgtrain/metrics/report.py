"""What a person reads of a run's loading: the verdict on what bounds it, and the advice it gives (the console's
table and progress bar: metrics/console.py)."""

from __future__ import annotations

import shlex
import statistics
from typing import Any

from imgtrain.data.loader import auto_num_workers
from imgtrain.data.stages import WORKER_STAGES
from imgtrain.metrics.host_bound import host_bound
from imgtrain.metrics.spread import MIN_WINDOWS, Rate, indistinguishable, windows_needed

# Above this share of step time spent waiting for data, the run is called input-bound.
INPUT_BOUND_WAIT = 0.10
EPOCH_START_NOTABLE = 0.03  # an epoch start costing more than this share of an epoch is named in the verdict


def threads_wait(summary: dict[str, Any]) -> float | None:
    """With data.engine=threads and 2 or more threads: their CPU share of their busy time when it is below
    GIL_BOUND_CPU (they waited for each other or for cores), else None."""
    loader, pipeline = summary.get("loader") or {}, summary.get("pipeline") or {}
    share = pipeline.get("loader_cpu_frac")
    threads = loader.get("engine") == "threads" and (loader.get("num_workers") or 0) >= 2
    return share if threads and share is not None and share < GIL_BOUND_CPU else None


def suggest_next(summary: dict[str, Any]) -> str:
    """The next loader setting worth trying when a run is input-bound."""
    loader = summary["loader"]
    workers = loader["num_workers"]
    threads = loader.get("engine") == "threads"
    if threads_wait(summary) is not None:  # more threads would wait too: processes do not share the GIL
        return "data.engine=dataloader"
    ranks, kept = summary.get("local_world_size", summary["world_size"]), loader.get("cores_kept", 1)
    most = auto_num_workers(ranks, cpus=summary["cpu_count"], kept=kept)
    if workers < most:  # the same budget as num_workers=auto: this process's CPUs minus its own threads' cores
        return f"data.num_workers={min(max(1, 2 * workers), most)}"
    if summary["device"].startswith("cuda") and not loader["pin_memory"]:
        return "data.pin_memory=true"
    if workers and not loader.get("persistent_workers") and not threads:
        return "data.persistent_workers=true"
    if workers and (loader.get("prefetch_factor") or 2) < 4 and not threads:  # threads: 2 each, fixed
        return "data.prefetch_factor=4"
    return "fewer CPU cycles per image: pre-resized or smaller images, or decoding on the GPU"


# Loader threads on a CPU less than this share of their busy time wait for each other (the GIL) or for cores: one
# thread on the 2-core machine ran 0.89 of its time, two threads on `shapes` at 32 px (Python-bound) 0.45
GIL_BOUND_CPU = 0.7
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
    if stage == "decode":
        return decode_advice(summary) or STAGE_ADVICE["decode"]
    if stage == "transfer" and ((summary.get("loader") or {}).get("pin_memory") or summary.get("device") == "cpu"):
        return STAGE_ADVICE["transfer"].removesuffix(", data.pin_memory=true")  # on already, or nothing to pin
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


# Below this median speed-up (per-file ratios, data/decode_sample.py), a way of decoding is not prescribed.
WORTH_IT = 1.1


def decode_advice(summary: dict[str, Any]) -> str | None:
    """What a decode-bound run's own files say would help (`pipeline.decode_sample`, data/decode_sample.py): their
    median size and decode time, the speed-up measured for them packed at --max-side N with the imgtrain-shards
    command, and scaled decoding's where it is off. None without a sample, or when packing would not change most
    of them (their median longer side at most N, which is at least twice the crop) or gain little."""
    sample = (summary.get("pipeline") or {}).get("decode_sample")
    packed = sample.get("packed_speedup") if sample else None
    if not packed or sample["longer_side"] <= sample["max_side"] or packed["median"] < WORTH_IT:
        return None
    side, dst, as_run = sample["max_side"], "<local dir>", sample["as_run"]
    given = sample.get("source") or ([summary["dataset_root"]] if summary.get("dataset_root") else [])
    source = [shlex.quote(str(arg)) for arg in given] or ["<image folder>"]  # the run's own, as a shell reads them
    command = " ".join(["imgtrain-shards", source[0], dst, *source[1:], "--max-side", str(side)])
    with_it = " with scaled decoding (dataset.scaled_decode=true, on in this run)" if as_run == "scaled" else ""
    words = (
        f"the {sample['files']} JPEGs sampled are {sample['megapixels']:.1f} MP (median) and decode in "
        f"{sample['ms'][as_run]:.1f} ms each{with_it}; packed at --max-side {side} they decode {_times(packed)}: "
        f"`{command}`, then dataset=shards dataset.root={dst}"
    )
    scaled = sample.get("scaled_speedup")
    if as_run != "scaled" and scaled and scaled["median"] >= WORTH_IT:
        words += f"; scaled decoding (dataset.scaled_decode=true) decodes them {_times(scaled)}"
    return words


def _times(speedup: dict[str, Any]) -> str:
    """`18.2x faster (files 15.1-21.0x)`: the median of the per-file ratios, and their quartiles."""
    low, high = speedup["quartiles"]
    return f"{speedup['median']:.1f}x faster (files {low:.1f}-{high:.1f}x)"


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


def contended_stage(summary: dict[str, Any]) -> str | None:
    """The worker stage that takes the CPUs when training runs far below the model's own rate, told apart from it
    by their intervals, while the workers keep the CPUs busy; None when that is not so."""
    pipeline = summary.get("pipeline") or {}
    training, own = training_rate(summary), model_rate(summary)
    if not training or not own or training.median >= CONTENDED_RATE * own.median or indistinguishable(training, own):
        return None
    if (pipeline.get("worker_busy_cores") or 0) < 0.25:
        return None
    per_image = pipeline["stage_ms_per_image"]
    return max((s for s in WORKER_STAGES if per_image.get(s)), key=lambda s: per_image[s], default="decode")


def contention(summary: dict[str, Any]) -> str | None:
    """CPU contention (`contended_stage`): the rates, the CPUs loading kept busy, and what takes them."""
    stage = contended_stage(summary)
    if stage is None:
        return None
    pipeline, per_image = summary["pipeline"], summary["pipeline"]["stage_ms_per_image"]
    training, own = training_rate(summary), model_rate(summary)
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


def threads_note(summary: dict[str, Any]) -> str:
    """`; the 2 loader threads ran on a CPU only 45% ...`: the stage will not scale on threads."""
    share = threads_wait(summary)
    if share is None:
        return ""
    return (
        f"; the {summary['loader']['num_workers']} loader threads ran on a CPU only {share:.0%} of their busy time: "
        "they wait for each other (Python's GIL, held by per-sample Python work such as an augmentation policy or a "
        "Dataset's own __getitem__) or for cores, so it will not scale on more threads; worker processes do not "
        "share the GIL (data.engine=dataloader)"
    )


def epoch_start_note(summary: dict[str, Any]) -> str:
    """`; each epoch start costs 0.36 s (5% of an epoch) ...` when it costs more than EPOCH_START_NOTABLE."""
    share, costs = summary.get("epoch_start_cost_frac"), summary.get("epoch_start_cost_s") or []
    if share is None or share <= EPOCH_START_NOTABLE:
        return ""
    loader = summary.get("loader") or {}
    remedy = ""
    if loader.get("num_workers") and not loader.get("persistent_workers") and loader.get("engine") != "threads":
        remedy = ": set data.persistent_workers=true (workers are started again at every epoch)"
    return f"; each epoch start costs {statistics.median(costs):.2f} s ({share:.0%} of an epoch){remedy}"


def _bound(summary: dict[str, Any], wait: float) -> str:
    pipeline = summary.get("pipeline")
    if wait > INPUT_BOUND_WAIT:
        stage = input_stage(pipeline)
        if stage is None:
            return f"input-bound: {wait:.0%} of step time waits for data; try {suggest_next(summary)}"
        more = suggest_next(summary) if stage in ("read", "decode", "augment") else None
        measured = decode_advice(summary) if stage == "decode" else None
        if measured:  # the files' own figures follow the stage's; then what else to try
            also = f"; or try {more}" if more and "num_workers" in more else ""
            words = f"input-bound: {wait:.0%} of step time waits for data; {_stage_words(stage, pipeline)}"
            return f"{words}: {measured}{also}" + threads_note(summary)
        advice = stage_advice(stage, summary)
        advice = advice if more is None or "num_workers" not in more else f"{more}, {advice}"
        words = f"input-bound: {wait:.0%} of step time waits for data; {_stage_words(stage, pipeline)}: try {advice}"
        return words + threads_note(summary)
    contended = contention(summary)
    if contended:
        return contended
    launches = host_bound(summary, wait)
    if launches:
        return launches
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


def decode_bound(summary: dict[str, Any]) -> bool:
    """Whether the verdict names decode as what bounds the run: input-bound in decode, or CPU-contended mostly in
    decode (a sample of its files then says what would help: data/decode_sample.py)."""
    wait = summary.get("data_wait_frac")
    if summary.get("mode") != "train" or wait is None:
        return False
    return (bounding_stage(summary) if wait > INPUT_BOUND_WAIT else contended_stage(summary)) == "decode"


def bounding_stage(summary: dict[str, Any]) -> str | None:
    """The input stage named by the verdict of an input-bound run (None otherwise)."""
    wait = summary.get("data_wait_frac")
    return input_stage(summary.get("pipeline")) if wait is not None and wait > INPUT_BOUND_WAIT else None
