"""Measuring instead of guessing: the model's own rate, and `data.num_workers=tune`.

`compute_rate` times training steps on a copy of the model, on one batch already on the device (what
mode=compute measures, in seconds instead of a whole run). `tune_workers` probes the training loader at a few
worker counts, for a fixed time each, and keeps the fewest workers that stay `AHEAD` of the model: past that,
more workers only take CPU and memory from the training process (pytorch/pytorch#23048 asks for this).
"""

from __future__ import annotations

import copy
import logging
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from imgtrain import dist
from imgtrain.config import Config, Precision
from imgtrain.data.failures import stop_workers
from imgtrain.data.feed import Feed
from imgtrain.data.loader import LoaderPlan
from imgtrain.data.pipeline import make_loader, plan_with_workers
from imgtrain.host import available_cpus
from imgtrain.metrics.report import INPUT_BOUND_WAIT
from imgtrain.optim import build_step

log = logging.getLogger(__name__)

AHEAD = 1.25  # the loader must deliver this many times the model's rate: headroom for jitter and validation
STARTUP_SHARE = 0.3  # of each probe's time slot left for starting its workers (not timed)
MIN_PROBE_S = 0.5
WARMUP_STEPS = 2  # untimed steps before the compute probe's clock starts
CONTENTION_PROBE_S = 3.0  # the model's own rate after training, when workers and training may share CPUs


def compute_rate(
    base: nn.Module,
    num_classes: int,
    settings: Config,
    device: torch.device,
    precision: Precision,
    memory_format: Any,
    seconds: float,
) -> float:
    """Images/s of full training steps (forward, loss, backward, update) on a copy of `base`, with a random batch
    of the run's shape already on the device: the model's rate with no input pipeline and no other load."""
    model = copy.deepcopy(base).train()  # the run's weights and BatchNorm statistics stay untouched
    step = build_step(settings, model, device, precision, (1, 1))
    size = settings.data.batch_size
    side = settings.dataset.image_size
    images = torch.randn(size, 3, side, side, device=device).contiguous(memory_format=memory_format)
    labels = torch.randint(0, num_classes, (size,), device=device)

    def one_step() -> None:  # the training loop's own step (optim.Step), on a batch already on the device
        _, loss = step.forward(model, images, labels)
        step.update(loss, schedule=False)

    for _ in range(WARMUP_STEPS):  # allocations, cuDNN autotuning, oneDNN primitives
        one_step()
    _sync(device)
    started, steps = time.perf_counter(), 0
    while steps < 2 or time.perf_counter() - started < seconds:
        one_step()
        _sync(device)  # each step timed to its end (microseconds next to a training step)
        steps += 1
    return steps * size / (time.perf_counter() - started)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def loader_rate(dataset: Any, plan: LoaderPlan, feed: Feed, seconds: float, info: dist.DistInfo, seed: int) -> float:
    """Images/s the training loader delivers onto the device with `plan`, over the second half of `seconds`
    after its first batch: start-up is left out, and so are the batches the workers had ready at the start."""
    loader = make_loader(dataset, plan, train=True, seed=seed, rank=info.rank, world_size=info.world_size)
    batches = iter(loader)
    try:
        with feed.batches(batches) as ready:
            next(ready)  # the workers have started
            started = time.perf_counter()
            arrivals: list[tuple[float, int]] = []
            for batch in ready:
                images, _ = feed.to_model(batch)
                arrivals.append((time.perf_counter() - started, images.shape[0]))
                if arrivals[-1][0] >= seconds:
                    break
            _sync(feed.device)
    finally:
        stop_workers(batches)  # persistent workers too: the probe's workers must not outlive it
    late = [(t, n) for t, n in arrivals if t >= seconds / 2]
    if len(late) >= 2:  # the images that arrived after the first late batch, over the time they took
        return sum(n for _, n in late[1:]) / max(late[-1][0] - late[0][0], 1e-9)
    return sum(n for _, n in arrivals) / max(arrivals[-1][0], 1e-9) if arrivals else 0.0


def worker_counts(cpus: int) -> list[int]:
    """0, 1, 2, 4, 8, ... up to `cpus` (and `cpus` - 1, auto's count): the counts worth probing."""
    counts = {0, cpus, max(0, cpus - 1)}
    power = 1
    while power < cpus:
        counts.add(power)
        power *= 2
    return sorted(counts)


def choose(table: list[dict[str, float]], compute: float) -> tuple[int, str]:
    """The fewest workers at least AHEAD x the compute rate; else the fastest (fewest on a tie)."""
    for row in table:
        if row["images_per_sec"] >= AHEAD * compute:
            return int(row["num_workers"]), (
                f"the fewest workers whose loader ({row['images_per_sec']:.1f} images/s) stays {AHEAD}x ahead of "
                f"the model ({compute:.1f} images/s)"
            )
    best = max(table, key=lambda row: (row["images_per_sec"], -row["num_workers"]))
    return int(best["num_workers"]), (
        f"no count kept the loader {AHEAD}x ahead of the model ({compute:.1f} images/s): the fastest loader "
        f"({best['images_per_sec']:.1f} images/s); the run will be input-bound"
    )


def tune_workers(
    dataset: Any, settings: Config, feed: Feed, info: dist.DistInfo, model_rate: Callable[[float], float]
) -> dict[str, Any]:
    """Probe the training loader at `worker_counts` of this rank's CPU share and choose (each rank for itself).

    `model_rate(seconds)` measures the model's images/s (`compute_rate`). Returns the probe table, that rate, the
    chosen count and why, for loader_args.json and metrics.json. The budget (data.tune_budget_s) is shared
    equally by the compute probe and each count.
    """
    share = max(1, available_cpus() // max(1, info.local_world_size))
    counts = worker_counts(share)
    slot = settings.data.tune_budget_s / (len(counts) + 1)
    seconds = max(MIN_PROBE_S, slot * (1 - STARTUP_SHARE))
    rate = model_rate(seconds)
    log.info("data.num_workers=tune: the model alone trains %.1f images/s; probing %s workers", rate, counts)
    table: list[dict[str, float]] = []
    for workers in counts:
        plan = plan_with_workers(settings.data, workers, feed.device.type, info)
        measured = loader_rate(dataset, plan, feed, seconds, info, settings.train.seed)
        table.append({"num_workers": workers, "images_per_sec": measured})
        log.info(
            "  num_workers=%-3d %10.1f images/s%s", workers, measured, "  (ahead)" if measured >= AHEAD * rate else ""
        )
    chosen, reason = choose(table, rate)
    log.info("data.num_workers=tune -> %d: %s", chosen, reason)
    return {"table": table, "compute_images_per_sec": rate, "chosen": chosen, "reason": reason, "cpus": share}


def contention_plausible(
    setting: bool | str, wait_frac: float | None, busy_cores: float, workers: int, device: torch.device
) -> bool:
    """Whether to time the model alone after training (metrics.compute_probe): always when true; with auto, when
    the run was not input-bound and its loading plus the training process asked for more CPUs than it has."""
    if setting is True or setting is False:
        return setting
    if wait_frac is None or workers == 0:
        return False
    training_threads = torch.get_num_threads() if device.type == "cpu" else 1  # a GPU run needs one core to launch
    return wait_frac <= INPUT_BOUND_WAIT and busy_cores + training_threads > available_cpus()
