"""The input pipeline's stage breakdown: the clocks in the workers, the transfer split, the meter, the verdict
that names a stage (or CPU contention), and `data.num_workers=tune`."""

from __future__ import annotations

import multiprocessing
import time
from pathlib import Path

import pytest
import torch
from helpers import FAST, compose_cfg, read_metrics
from torch.utils.data import Dataset

from imgtrain.config.validate import validate
from imgtrain.data import stages
from imgtrain.data.datasets import build_shapes
from imgtrain.data.feed import Feed
from imgtrain.data.loader import plan_loader
from imgtrain.data.samples import GuardedSamples, collate
from imgtrain.host import dist
from imgtrain.host.cpus import CpuBudget
from imgtrain.metrics import report
from imgtrain.metrics.spread import Rate
from imgtrain.metrics.stage_breakdown import PipelineMeter
from imgtrain.train import tune
from imgtrain.train.run import run


def test_a_sample_records_read_decode_and_augment_and_a_batch_sums_them(tmp_path: Path) -> None:
    bundle = build_shapes("shapes", 32, [0.5] * 3, [0.25] * 3, True, str(tmp_path), 20, 10, 0)
    samples = GuardedSamples(bundle.train)
    items = [samples[i] for i in range(4)]
    assert all(times is not None and min(times) > 0 for *_, times in items)
    for *_, (read, decode, augment, total) in items:
        assert read + decode + augment <= total  # the stages are parts of the sample's own time
    batch = collate(items)
    times = batch.times
    assert times.samples == 4 and times.collate > 0
    assert times.read == pytest.approx(sum(t[3][0] for t in items))
    assert times.busy == pytest.approx(sum(t[3][3] for t in items) + times.collate)
    assert abs(times.finished - time.perf_counter()) < 5  # the monotonic clock every process shares
    untimed = GuardedSamples(bundle.train, timed=False)
    assert collate([untimed[0], untimed[1]]).times == ()


class Plain(Dataset):
    """A Dataset of someone's own that records no stages: its whole __getitem__ counts as decode."""

    def __len__(self) -> int:
        return 4

    def __getitem__(self, index: int):
        time.sleep(0.002)
        return torch.zeros(3, 4, 4, dtype=torch.uint8), 0


def test_a_dataset_that_records_nothing_counts_as_decode() -> None:
    *_, (read, decode, augment, total) = GuardedSamples(Plain())[0]
    assert read == 0 and augment == 0 and decode == total >= 0.002


def test_transfer_is_the_part_of_the_wait_after_the_batch_was_finished() -> None:
    times = stages.BatchTimes(finished=10.0)
    assert stages.transfer_seconds(times, wait_started=9.0, received=10.5) == pytest.approx(0.5)  # worker busy
    assert stages.transfer_seconds(times, wait_started=11.0, received=11.2) == pytest.approx(0.2)  # ready before
    assert stages.transfer_seconds((), 0.0, 1.0) == 0.0  # untimed batches


def _meter_with(batches: int, workers: int, seconds: float, wait: float, transfer: float) -> dict:
    meter = PipelineMeter(workers)
    for _ in range(batches):
        times = stages.BatchTimes(read=0.008, decode=0.032, augment=0.016, collate=0.004, busy=0.06, samples=8)
        meter.add(wait, transfer, times)
    values = meter.close_window(seconds, steady=True)
    return values | {"summary": meter.summary()}


def test_the_meter_reports_per_image_stages_and_how_busy_the_workers_were() -> None:
    out = _meter_with(batches=10, workers=2, seconds=1.0, wait=0.02, transfer=0.005)
    assert out["pipeline/decode_ms_per_image"] == pytest.approx(4.0)  # 32 ms per batch of 8
    assert out["pipeline/collate_ms_per_batch"] == pytest.approx(4.0)
    assert out["pipeline/worker_busy_frac"] == pytest.approx(0.3)  # 0.6 s busy over 1 s x 2 workers
    assert out["pipeline/transfer_frac_of_wait"] == pytest.approx(0.25)
    summary = out["summary"]
    per_image = summary["stage_ms_per_image"]
    assert per_image["read"] == pytest.approx(1.0) and per_image["augment"] == pytest.approx(2.0)
    assert per_image["collate"] == pytest.approx(0.5) and per_image["transfer"] == pytest.approx(0.625)
    assert per_image["h2d"] is None and per_image["gpu_decode"] is None  # no copy on a CPU device
    assert summary["worker_busy_cores"] == pytest.approx(0.6)


def _summary(wait: float, per_image: dict, *, busy: float = 0.9, transfer: float = 0.1, **extra) -> dict:
    stage_ms = dict.fromkeys(stages.STAGES) | per_image
    pipeline = {"stage_ms_per_image": stage_ms, "worker_busy_frac": busy, "worker_busy_cores": busy * 4}
    pipeline |= {"transfer_frac_of_wait": transfer, "workers": 4, "compute_images_per_sec": None}
    pipeline |= extra.pop("pipeline", {})
    loader = {"num_workers": 4, "pin_memory": True, "persistent_workers": True, "prefetch_factor": 2}
    summary = {"mode": "train", "data_wait_frac": wait, "loader": loader, "world_size": 1, "local_world_size": 1}
    return summary | {"cpu_count": 8, "device": "cuda:0", "pipeline": pipeline} | extra


@pytest.mark.parametrize(
    ("per_image", "busy", "transfer", "stage", "advice"),
    [
        ({"read": 0.1, "decode": 2.0, "augment": 0.5}, 0.9, 0.1, "decode", "dataset.decode=cuda"),
        (
            {"read": 3.0, "decode": 1.0, "augment": 0.5},
            0.9,
            0.1,
            "read",
            "`make shards SRC=/data/imgs DST=<local dir>`",
        ),
        ({"read": 0.1, "decode": 0.5, "augment": 2.0}, 0.9, 0.1, "augment", "augmenting on the GPU"),
        ({"read": 0.1, "decode": 0.5, "augment": 0.2}, 0.9, 0.8, "transfer", "larger batches"),
        ({"read": 0.1, "decode": 0.5, "augment": 0.2}, 0.2, 0.1, "idle", "data.prefetch_factor"),
    ],
)
def test_an_input_bound_verdict_names_the_stage_and_what_addresses_it(per_image, busy, transfer, stage, advice):
    summary = _summary(0.4, per_image, busy=busy, transfer=transfer, dataset="imagefolder", dataset_root="/data/imgs")
    verdict = report.verdict(summary)
    assert verdict.startswith("input-bound: 40% of step time waits for data")
    assert report.bounding_stage(summary) == stage and advice in verdict
    assert ("takes the most input time" in verdict) == (stage not in ("transfer", "idle"))


@pytest.mark.parametrize(
    ("dataset", "root", "advice"),
    [
        ("imagefolder", "/nfs/imgs", "make shards SRC=/nfs/imgs DST=<local dir>`, then dataset=shards"),
        ("shards", "s3://bucket/imgs", "`aws s3 sync s3://bucket/imgs <local dir>`"),
        ("shards", "/nfs/shards", "local disk or the page cache (copy the dataset off network storage)"),
    ],
)
def test_a_read_bound_verdict_prescribes_what_fits_where_the_data_is(dataset: str, root: str, advice: str) -> None:
    summary = _summary(0.4, {"read": 3.0, "decode": 1.0, "augment": 0.5}, dataset=dataset, dataset_root=root)
    assert advice in report.verdict(summary)


def test_workers_taking_the_cpus_the_model_needs_is_not_called_compute_bound() -> None:
    per_image = {"read": 0.1, "decode": 3.0, "augment": 0.5}
    contended = _summary(0.02, per_image, pipeline={"compute_images_per_sec": 400.0}, images_per_sec_per_process=180.0)
    verdict = report.verdict(contended)
    assert verdict.startswith("CPU-contended: training ran at 180.0 images/s, 45% of the model's own rate")
    assert "most of it in decode (3.00 ms per image)" in verdict and "data.num_workers=3" in verdict
    fine = _summary(0.02, per_image, pipeline={"compute_images_per_sec": 200.0}, images_per_sec_per_process=190.0)
    assert report.verdict(fine).endswith("(training ran at 95% of the model's own 200.0 images/s)")
    faster = _summary(0.02, per_image, pipeline={"compute_images_per_sec": 95.8}, images_per_sec_per_process=123.8)
    assert report.verdict(faster).endswith(
        "(training and the model alone are indistinguishable: 123.8 against 95.8 images/s, within their noise)"
    )


def test_the_verdict_compares_training_with_the_model_by_their_intervals() -> None:
    """Twelve windows around 100 images/s: against a model probe of 104 (98-110) they are indistinguishable, never
    "104%"; against 150 (140-160) training ran at 67% of it; far below and separated it is contention."""
    windows = [100.0 + d for d in (-2, -1, 0, 1, 2, 0) * 2]  # median 100
    per_image = {"read": 0.1, "decode": 3.0, "augment": 0.5}

    def summary(compute: float, interval: list[float]) -> dict:
        pipeline = {"compute_images_per_sec": compute, "compute_images_per_sec_interval": interval}
        return _summary(0.02, per_image, busy=0.01, pipeline=pipeline, images_per_sec_windows=windows)

    close = report.verdict(summary(104.0, [98.0, 110.0]))
    assert "(training and the model alone are indistinguishable: 100.0 against 104.0 images/s" in close
    assert "%" not in close.split("(training")[1]
    below = report.verdict(summary(150.0, [140.0, 160.0]))
    assert below.endswith("(training ran at 67% of the model's own 150.0 images/s, 95% interval 140.0-160.0)")
    contended = _summary(0.02, per_image, pipeline={"compute_images_per_sec": 150.0}, images_per_sec_windows=windows)
    assert report.verdict(contended).startswith("CPU-contended: training ran at 100.0 images/s, 67% of the model's")


def test_the_compute_probe_runs_when_loading_and_training_ask_for_more_cpus_than_there_are(monkeypatch) -> None:
    monkeypatch.setattr(tune, "available_cpus", lambda: 4)
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert tune.contention_plausible("auto", 0.01, busy_cores=3.5, workers=3, device=cuda)  # 3.5 + 1 > 4
    assert not tune.contention_plausible("auto", 0.01, busy_cores=2.0, workers=3, device=cuda)
    assert not tune.contention_plausible("auto", 0.5, busy_cores=3.5, workers=3, device=cuda)  # input-bound
    assert not tune.contention_plausible("auto", 0.01, busy_cores=3.5, workers=0, device=cpu)
    assert tune.contention_plausible(True, None, 0.0, 0, cpu) and not tune.contention_plausible(False, 0.0, 9, 9, cpu)


def _rounds(rate: float, noise: float, n: int = 6) -> Rate:
    """A candidate probed in `n` rounds around `rate`, each within +-noise."""
    return Rate.of([rate + noise * ((i % 3) - 1) for i in range(n)])


def test_tune_keeps_the_fewest_workers_comfortably_ahead_else_the_fastest() -> None:
    table = {w: _rounds(r, 2.0) for w, r in [(0, 90.0), (1, 130.0), (2, 260.0), (4, 262.0)]}
    assert tune.choose(table, compute=_rounds(100.0, 1.0))[0] == 1  # 130 >= 1.25 x 100
    assert tune.choose(table, compute=_rounds(200.0, 1.0))[0] == 2
    chosen, reason, separated = tune.choose(table, compute=_rounds(1000.0, 1.0))
    assert chosen == 2 and "tied within noise with [4]" in reason and "the run will be input-bound" in reason
    assert not separated  # 260 and 262, each +-2: their intervals overlap, so the fewer workers
    table[4] = _rounds(300.0, 2.0)
    chosen, reason, separated = tune.choose(table, compute=_rounds(1000.0, 1.0))
    assert chosen == 4 and separated
    assert tune.worker_counts(16) == [0, 1, 2, 4, 8, 15, 16] and tune.worker_counts(2) == [0, 1, 2]


def test_tune_says_how_sure_its_choice_is() -> None:
    """Separated: the chosen loader's interval clears 1.25x the model's and the fewer count's stays below it.
    A loader within noise of the line, or too few rounds for intervals, is not separated."""
    compute = _rounds(100.0, 1.0)
    chosen, reason, separated = tune.choose({0: _rounds(90.0, 2.0), 1: _rounds(140.0, 2.0)}, compute)
    assert chosen == 1 and separated
    assert reason.startswith("the fewest workers whose loader stays ahead of 1.25x the model's 100.0 images/s")
    assert "its interval's low end is +9% from the line's high end" in reason
    chosen, _, separated = tune.choose({0: _rounds(90.0, 2.0), 1: _rounds(126.0, 4.0)}, compute)
    assert chosen == 1 and not separated  # 122-130 against the line's 123.75-126.25
    _, _, separated = tune.choose({0: _rounds(90.0, 2.0, n=3), 1: _rounds(140.0, 2.0, n=3)}, _rounds(100.0, 1.0, n=3))
    assert not separated  # three rounds: no interval yet


class Images(Dataset):
    """In-memory images; with `delay`, each sample sleeps like a slow decode."""

    def __init__(self, delay: float) -> None:
        self.delay, self.transform = delay, None

    def __len__(self) -> int:
        return 4096

    def __getitem__(self, index: int):
        time.sleep(self.delay)
        return torch.zeros(3, 8, 8, dtype=torch.uint8), index % 10


@pytest.mark.slow  # 6 probes of about a second each
def test_a_slow_dataset_makes_tune_choose_more_workers_than_a_fast_one(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tune, "cpu_budget", lambda: CpuBudget(affinity=2, quota=None))
    settings = validate(compose_cfg(*FAST, "data.batch_size=8", "data.tune_budget_s=4"))
    feed = Feed(torch.device("cpu"), torch.zeros(1, 3, 1, 1), torch.ones(1, 3, 1, 1), torch.contiguous_format, False)
    info = dist.DistInfo(rank=0, local_rank=0, world_size=1, local_world_size=1)
    model_rate = lambda seconds: Rate(300.0, None, 1)  # noqa: E731 - images/s: 10 ms per image is far too slow
    plan = lambda workers, engine=None: plan_loader(  # noqa: E731
        settings.data, train=True, device_type="cpu", workers=workers, engine=engine
    )
    slow = tune.tune_workers(Images(0.01), settings, plan, feed, info, model_rate)
    fast = tune.tune_workers(Images(0.0), settings, plan, feed, info, model_rate)
    assert [row["num_workers"] for row in slow["table"]] == [0, 1, 2]
    assert fast["chosen"] == 0 and fast["table"][0]["images_per_sec"] > 375  # ahead without workers
    rates = [row["images_per_sec"] for row in slow["table"]]
    assert slow["chosen"] == 2 and rates[2] > 1.5 * rates[0], rates  # sleeping workers overlap: ~2x


@pytest.mark.slow
def test_a_tuned_run_records_its_probe_and_trains_with_the_choice(tmp_path: Path, data_dir: Path, monkeypatch) -> None:
    modes = []  # the probe times a copy compiled as the run's model is (compiling itself is not the point here)
    monkeypatch.setattr(torch, "compile", lambda model, mode=None, **kw: modes.append(mode) or model)
    compiled = ["system.compile=true", "system.compile_mode=max_autotune_no_cudagraphs"]
    run(compose_cfg(*FAST, *compiled, "data.num_workers=tune", "data.tune_budget_s=3", output_dir=str(tmp_path)))
    assert modes == ["max-autotune-no-cudagraphs"] * 2  # the run's model, then the probe's copy
    metrics = read_metrics(tmp_path)
    tuned = metrics["tune"]
    assert [row["num_workers"] for row in tuned["table"]][0] == 0 and tuned["compute_images_per_sec"] > 0
    assert metrics["loader"]["num_workers"] == tuned["chosen"]
    saved = (tmp_path / "loader_args.json").read_text()
    assert '"tune"' in saved and f'"num_workers": {tuned["chosen"]}' in saved
    assert metrics["pipeline"]["compute_images_per_sec"] == tuned["compute_images_per_sec"]
    assert tuned["rounds"] >= 1 and isinstance(tuned["separated"], bool)
    assert all("images_per_sec_interval" in row for row in tuned["table"])
    assert metrics["pipeline"]["compute_images_per_sec_interval"] == tuned["compute_images_per_sec_interval"]


@pytest.mark.slow  # a run, then the model alone for 3 s
def test_the_model_alone_is_timed_with_its_interval_after_training(tmp_path: Path, data_dir: Path) -> None:
    run(compose_cfg(*FAST, "metrics.compute_probe=true", output_dir=str(tmp_path)))
    pipeline = read_metrics(tmp_path)["pipeline"]
    low, high = pipeline["compute_images_per_sec_interval"]  # at least 6 steps, each a sample
    assert 0 < low <= pipeline["compute_images_per_sec"] <= high


def test_fed_tune_keeps_the_fewest_workers_tied_with_the_fastest_training() -> None:
    """On a GPU each count is timed training on its own loader: workers that slow the launching thread lose, and
    of the counts noise cannot tell apart the fewest is kept."""
    contended = {w: _rounds(r, 2.0) for w, r in [(0, 300.0), (2, 500.0), (4, 502.0), (8, 420.0)]}
    chosen, reason, separated = tune.fed_choice(contended)
    assert chosen == 2 and not separated and "tied within noise with [4]" in reason
    assert tune.fed_choice({w: _rounds(r, 2.0) for w, r in [(1, 300.0), (2, 500.0), (4, 420.0)]})[0] == 2


@pytest.mark.slow  # 4 probes a round, each a fraction of a second, a few rounds
def test_a_gpu_runs_tune_times_training_on_each_loader_and_keeps_fewer_workers(monkeypatch) -> None:
    """The launching thread's contention, played on the CPU: each training step costs 4 ms per live worker
    process, so the loader alone is fastest with the most workers, training with the fewest."""
    monkeypatch.setattr(tune, "cpu_budget", lambda: CpuBudget(affinity=2, quota=None))
    settings = validate(compose_cfg(*FAST, "data.batch_size=8", "data.tune_budget_s=4"))
    feed = Feed(torch.device("cpu"), torch.zeros(1, 3, 1, 1), torch.ones(1, 3, 1, 1), torch.contiguous_format, False)
    info = dist.DistInfo(rank=0, local_rank=0, world_size=1, local_world_size=1)
    steps: list[int] = []

    def train(images: torch.Tensor, labels: torch.Tensor) -> None:
        steps.append(images.shape[0])
        time.sleep(0.004 * len(multiprocessing.active_children()))

    plan = lambda workers, engine=None: plan_loader(  # noqa: E731
        settings.data, train=True, device_type="cpu", workers=workers, engine=engine
    )
    tuned = tune.tune_workers(Images(0.0), settings, plan, feed, info, lambda s: Rate(300.0, None, 1), train)
    assert steps and tuned["chosen"] == 0, tuned["table"]
    assert "each timed training on its own loader" in tuned["reason"]
