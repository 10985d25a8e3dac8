"""Measuring instead of guessing: the model's own rate, and `data.num_workers=tune`.

`probe.ModelProbe` times training steps of the model as the run runs it, on one batch already on the device
(what mode=compute measures, in seconds instead of a whole run), each step a sample of its spread. `tune_workers`
probes the model and the training loader at a few worker counts in interleaved rounds, until the choice is
separated from the noise or the budget is spent, and keeps the fewest workers that stay `AHEAD` of the model:
past that, more workers only take CPU and memory from the training process (pytorch/pytorch#23048 asks for
this). The rule is the sweep report's (sweep/rank.py): a figure counts with its 95% interval, and of settings
that noise cannot tell apart the cheapest is kept.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any, NamedTuple

import torch

from imgtrain.config.data import LoaderEngine
from imgtrain.config.schema import Config
from imgtrain.data.failures import stop_workers
from imgtrain.data.feed import Feed
from imgtrain.data.loader import LoaderPlan
from imgtrain.data.pipeline import build_loader, check_batches
from imgtrain.host import dist, optional
from imgtrain.host.cpus import CpuBudget, available_cpus, cpu_budget
from imgtrain.metrics.report import INPUT_BOUND_WAIT
from imgtrain.metrics.spread import MIN_WINDOWS, Rate, indistinguishable

log = logging.getLogger(__name__)

AHEAD = 1.25  # the loader must deliver this many times the model's rate: headroom for jitter and validation
STARTUP_SHARE = 0.3  # of each probe's time slot left for starting its workers (not timed)
MIN_PROBE_S = 0.5
CONTENTION_PROBE_S = 3.0  # the model's own rate after training, when workers and training may share CPUs


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def loader_rate(
    dataset: Any,
    plan: LoaderPlan,
    feed: Feed,
    seconds: float,
    info: dist.DistInfo,
    seed: int,
    train: Callable[[torch.Tensor, torch.Tensor], None] | None = None,
) -> float:
    """Images/s the training loader delivers onto the device with `plan`, over the second half of `seconds`
    after its first batch: start-up is left out, and so are the batches the workers had ready at the start.
    `train(images, labels)`: a training step on each batch (a GPU run's probe, `fed`): the rate is then training's,
    fed by this loader, with whatever its workers take from the thread that launches the step."""
    loader = build_loader(dataset, plan, train=True, seed=seed, rank=info.rank, world_size=info.world_size)
    check_batches(loader, dataset, plan.kwargs["batch_size"], info.world_size)  # a split smaller than one batch
    batches = iter(loader)
    try:
        with feed.batches(batches) as ready:
            next(ready)  # the workers have started
            started = time.perf_counter()
            arrivals: list[tuple[float, int]] = []
            for batch in ready:
                images, labels = feed.to_model(batch)
                if train is not None:
                    train(images, labels)
                arrivals.append((time.perf_counter() - started, images.shape[0]))
                if arrivals[-1][0] >= seconds:
                    break
            _sync(feed.device)
            if train is not None and arrivals:  # the last step's time is when the GPU finished it
                arrivals[-1] = (time.perf_counter() - started, arrivals[-1][1])
    finally:
        stop_workers(batches)  # persistent workers too: the probe's workers must not outlive it
    late = [(t, n) for t, n in arrivals if t >= seconds / 2]
    if len(late) >= 2:  # the images that arrived after the first late batch, over the time they took
        return sum(n for _, n in late[1:]) / max(late[-1][0] - late[0][0], 1e-9)
    return sum(n for _, n in arrivals) / max(arrivals[-1][0], 1e-9) if arrivals else 0.0


class Candidate(NamedTuple):
    """A loader setting the probe measures. Ordered by cost: fewer workers first, then loader threads before worker
    processes at the same count (no processes to start, no /dev/shm: the sweep report's tie order)."""

    workers: int
    processes: bool = True  # data.engine=dataloader (or no workers); False: data.engine=threads

    @property
    def engine(self) -> LoaderEngine:
        return LoaderEngine.dataloader if self.processes else LoaderEngine.threads

    def label(self, engines: bool) -> str:
        return f"num_workers={self.workers}" + (f" engine={self.engine}" if engines and self.workers else "")


def candidates_of(counts: list[int], engine: LoaderEngine) -> list[Candidate]:
    """The settings to probe: each count on the run's engine; with data.engine=tune, each count of workers on
    both engines (threads only where torchdata is installed: otherwise said once, and processes alone)."""
    if engine != LoaderEngine.tune:
        return [Candidate(workers, engine != LoaderEngine.threads or workers == 0) for workers in counts]
    if optional.missing("torchdata"):
        log.warning(
            "data.engine=tune: torchdata is not installed (pip install -e '.[threads]'): probing processes only"
        )
        return [Candidate(workers) for workers in counts]
    return sorted({Candidate(workers, processes) for workers in counts for processes in (True, workers == 0)})


def worker_counts(cpus: int) -> list[int]:
    """0, 1, 2, 4, 8, ... up to `cpus` (and `cpus` - 1, auto's count): the counts worth probing."""
    counts = {0, cpus, max(0, cpus - 1)}
    power = 1
    while power < cpus:
        counts.add(power)
        power *= 2
    return sorted(counts)


def choose(candidates: dict[Any, Rate], compute: Rate) -> tuple[Any, str, bool]:
    """The fewest workers whose loader's median is at least AHEAD x the model's; else the fastest loader, or
    the fewest workers tied with it within noise. Returns the count, why (with each figure's spread and the
    margin), and whether the choice is separated: its figures' intervals do not reach across the line it
    rests on, so more rounds would not change it."""
    target = AHEAD * compute.median
    line = f"{AHEAD}x the model's {compute.text(of='rounds')}"
    ahead = [workers for workers, rate in candidates.items() if rate.median >= target]
    if ahead:
        chosen = min(ahead)
        low, high = _bounds(candidates[chosen])
        fewer = [_bounds(rate)[1] for workers, rate in candidates.items() if workers < chosen]
        line_low, line_high = (AHEAD * bound for bound in _bounds(compute))
        measured = compute.interval is not None and all(rate.interval is not None for rate in candidates.values())
        separated = measured and low >= line_high and all(bound < line_low for bound in fewer)
        margin = f"its interval's low end is {low / line_high - 1:+.0%} from the line's high end"
        if fewer:
            margin += f"; the next fewer count's high end {max(fewer) / line_low - 1:+.0%} from its low end"
        why = f"the fewest workers whose loader stays ahead of {line} ({margin})"
        return chosen, why, separated
    leader = max(candidates, key=lambda key: (candidates[key].median, -_cost(key)))
    tied = [w for w, rate in candidates.items() if w == leader or indistinguishable(rate, candidates[leader])]
    chosen = min(tied)
    separated = len(tied) == 1 and candidates[leader].interval is not None
    others = sorted(set(tied) - {chosen})
    shown = [key.label(engines=True) for key in others] if others and isinstance(chosen, Candidate) else others
    ties = f"; tied within noise with {shown}" if len(tied) > 1 else ""
    why = (
        f"no count kept the loader ahead of {line}: the fastest loader, or the fewest workers tied with it"
        f"{ties}; the run will be input-bound"
    )
    return chosen, why, separated


def fed_choice(candidates: dict[Any, Rate]) -> tuple[Any, str, bool]:
    """Each count timed training on its own loader: the fewest workers that noise cannot tell apart from the fastest
    training rate (more workers than that only take cores from the launching thread and memory). Separated when
    the fastest stands alone, its interval clear of every other."""
    leader = max(candidates, key=lambda key: (candidates[key].median, -_cost(key)))
    tied = [key for key, rate in candidates.items() if key == leader or indistinguishable(rate, candidates[leader])]
    chosen = min(tied, key=_cost)
    separated = len(tied) == 1 and candidates[leader].interval is not None
    others = [key.label(engines=True) if isinstance(key, Candidate) else key for key in tied if key != chosen]
    ties = f", tied within noise with {others}" if others else ""
    why = f"the fewest workers training as fast as the fastest, each timed training on its own loader{ties}"
    return chosen, why, separated


def _cost(key: Any) -> float:
    """A candidate's place in the cost order, as one number (ints: worker counts alone)."""
    return key.workers + 0.5 * key.processes if isinstance(key, Candidate) else key


def _bounds(rate: Rate) -> tuple[float, float]:
    """A rate's interval; its median at both ends when it has none (a round or two only)."""
    return rate.interval if rate.interval is not None else (rate.median, rate.median)


def worker_candidates(local_world_size: int) -> tuple[list[int], CpuBudget]:
    """The worker counts to probe, from this process's share of the CPUs (affinity and cgroup quota alike)."""
    cpus = cpu_budget()
    return worker_counts(max(1, cpus.usable // max(1, local_world_size))), cpus


def tune_workers(
    dataset: Any,
    settings: Config,
    plan: Callable[[int], LoaderPlan],
    feed: Feed,
    info: dist.DistInfo,
    model_rate: Callable[[float], Rate],
    fed: Callable[[torch.Tensor, torch.Tensor], None] | None = None,
) -> dict[str, Any]:
    """Probe the model alone and the training loader at `worker_counts` of this rank's CPU share, in interleaved
    rounds, and choose (each rank for itself) once the choice is separated or data.tune_budget_s is spent.
    `plan(workers)`: the run's training plan with `workers` workers (RunData.train_plan), so the probe plans as
    training will; the training loader is built afterwards, once, with the choice (RunData.build_train).

    `model_rate(seconds)` measures the model's images/s (a `probe.ModelProbe`, built beforehand). Each round
    probes the model, then each count, for the same time: a machine that slows down during tuning slows every
    candidate alike. A probe gives one sample per round; after `MIN_WINDOWS` rounds each candidate has a 95%
    interval (metrics/spread.py).
    With `fed` (a training step on a batch: a GPU run's), each count is timed training on its loader's batches
    (`fed_choice`): on one H200 15 workers slowed the thread that launches the step by 30% (2026-11-27), which a
    loader timed alone never shows, so fewer workers can train faster than more.
    Returns the probe table, the model's rate, the chosen count, why and how sure, for loader_args.json and
    metrics.json.
    """
    counts, cpus = worker_candidates(info.local_world_size)
    share = counts[-1]  # this process's share of the CPUs: the largest count probed
    budget = settings.data.tune_budget_s
    probes = len(candidates_of(counts, settings.data.engine))
    seconds = max(MIN_PROBE_S, budget / (MIN_WINDOWS * (probes + 1)) * (1 - STARTUP_SHARE))
    log.info(
        "data.num_workers=tune: probing the model alone and %s workers, %.1f s each per round (%d CPUs, set by %s)",
        *(counts, seconds, cpus.usable, cpus.limited_by),
    )
    samples: dict[Candidate, list[float]] = {key: [] for key in candidates_of(counts, settings.data.engine)}
    compute: list[float] = []
    started, rounds = time.perf_counter(), 0
    while True:
        round_started = time.perf_counter()
        compute.append(model_rate(seconds).median)
        for key in samples:
            rate = loader_rate(
                dataset, plan(key.workers, key.engine), feed, seconds, info, settings.train.seed + rounds, fed
            )
            samples[key].append(rate)
        rounds += 1
        candidates = {key: Rate.of(rates) for key, rates in samples.items()}
        chosen, reason, separated = fed_choice(candidates) if fed else choose(candidates, Rate.of(compute))
        spent, last_round = time.perf_counter() - started, time.perf_counter() - round_started
        if (separated and rounds >= MIN_WINDOWS) or spent + last_round > budget:
            break
    return _tuned(candidates, Rate.of(compute), (chosen, reason, separated), rounds, share)


def _tuned(
    candidates: dict[Candidate, Rate], compute: Rate, choice: tuple[Candidate, str, bool], rounds: int, cpus: int
) -> dict[str, Any]:
    """Log each candidate's rate with its spread and the choice with its margin; the record for metrics.json."""
    chosen, reason, separated = choice
    engines = len({key.processes for key in candidates if key.workers}) > 1  # data.engine=tune probed both
    log.info("data.num_workers=tune, %d round(s): the model alone %s", rounds, compute.text(of="rounds"))
    for key, rate in candidates.items():
        ahead = "  (ahead)" if rate.median >= AHEAD * compute.median else ""
        log.info("  %-30s %s%s", key.label(engines), rate.text(of="rounds"), ahead)
    how_sure = "separated" if separated else f"not separated within data.tune_budget_s ({rounds} rounds)"
    log.info("data.num_workers=tune -> %s: %s; %s", chosen.label(engines), reason, how_sure)
    table = [
        {"num_workers": key.workers, "engine": str(key.engine), **rate.fields("images_per_sec")}
        for key, rate in candidates.items()
    ]
    record = {"table": table, **compute.fields("compute_images_per_sec"), "chosen": chosen.workers}
    record |= {"engine": str(chosen.engine), "reason": reason}
    return record | {"separated": separated, "rounds": rounds, "cpus": cpus}


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
