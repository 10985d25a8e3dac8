"""data.engine=threads (data/threads.py): loader threads through torchdata.nodes give the DataLoader's batches, in
its order, switch with it mid-epoch, and end every way a loader can fail in one line."""

from __future__ import annotations

import json
import os
import sqlite3
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from helpers import RESUMABLE, compose_cfg, read_metrics
from PIL import Image
from shardhelpers import stop_after_step_5

from imgtrain.common.errors import ConfigError
from imgtrain.config.data import DataConfig, LoaderEngine
from imgtrain.config.validate import validate
from imgtrain.data import reads
from imgtrain.data.datasets import build_shapes
from imgtrain.data.failures import LoaderFailed
from imgtrain.data.image_files import ImageFileDataset
from imgtrain.data.loader import plan_loader
from imgtrain.data.pipeline import build_loader
from imgtrain.data.samplers import EpochSampler
from imgtrain.data.samples import GuardedSamples
from imgtrain.data.threads import ThreadLoader, shared_handles
from imgtrain.host import optional
from imgtrain.metrics import console, report
from imgtrain.metrics.spread import Rate
from imgtrain.train import tune
from imgtrain.train.run import run


@pytest.fixture(scope="module")
def shapes(tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("shapes")
    return build_shapes("shapes", 32, [0.5] * 3, [0.25] * 3, "trivialaugment", str(root), 72, 10, 0, random_erasing=0.5)


def _epochs(bundle, engine: LoaderEngine, workers: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    data = DataConfig(batch_size=16, num_workers=workers, engine=engine, persistent_workers=False)
    loader = build_loader(bundle.train, plan_loader(data, train=True, device_type="cpu"), train=True, seed=3)
    assert isinstance(loader, ThreadLoader) == (engine == LoaderEngine.threads and workers > 0)
    batches = []
    for epoch, start in ((0, 0), (1, 0), (1, 32)):  # two epochs, then the second resumed after 2 batches
        loader.sampler.set_epoch(epoch, start=start)
        batches += [(batch.images, batch.labels) for batch in loader]
    return batches


def test_threads_give_the_dataloaders_batches_in_its_order(shapes) -> None:
    """The same images (crop, policy, noise erasing: each sample's draws from its own seed) and labels, batch for
    batch, over two epochs and a resumed one: an engine can be switched mid-run."""
    processes = _epochs(shapes, LoaderEngine.dataloader, 2)
    for threads in (1, 3):
        batches = _epochs(shapes, LoaderEngine.threads, threads)
        assert len(batches) == len(processes) == 4 + 4 + 2
        for (images, labels), (want_images, want_labels) in zip(batches, processes, strict=True):
            assert torch.equal(labels, want_labels) and torch.equal(images, want_images)


def test_the_plan_records_the_engine_and_what_threads_ignore() -> None:
    data = DataConfig(num_workers=2, engine=LoaderEngine.threads, prefetch_factor=4)
    plan = plan_loader(data, train=True, device_type="cpu")
    assert plan.threads and plan.describe()["engine"] == "threads" and plan.kwargs["prefetch_factor"] == 2
    assert any("data.engine=threads: ignoring data.prefetch_factor=4" in note for note in plan.notes)
    assert not plan_loader(data, train=False, device_type="cpu").threads  # validation keeps the DataLoader
    assert not plan_loader(
        DataConfig(num_workers=0, engine=LoaderEngine.threads), train=True, device_type="cpu"
    ).threads


class _Stuck(torch.utils.data.Dataset):
    """Index 5 never finishes reading; 7 raises."""

    def __init__(self, stuck: threading.Event) -> None:
        self.stuck = stuck

    def __len__(self) -> int:
        return 16

    def path(self, index: int) -> str:
        return f"/mnt/gone/{index}.jpg"

    def __getitem__(self, index: int):
        if index == 5:
            self.stuck.wait()  # a read on a dead mount
        if index == 7:
            raise ValueError("a bug in __getitem__")
        return torch.zeros(3, 4, 4), index


def _loader(dataset, timeout: float) -> ThreadLoader:
    sampler = EpochSampler(len(dataset), num_replicas=1, rank=0, shuffle=False, seed=0, drop_last=True)
    samples = GuardedSamples(dataset, seeded_loads=False)  # as build_loader makes them for threads
    return ThreadLoader(samples, sampler, batch_size=2, drop_last=True, threads=2, timeout=timeout)


def test_a_stuck_read_ends_the_wait_after_data_timeout_naming_its_files() -> None:
    stuck = threading.Event()
    loader = _loader(_Stuck(stuck), timeout=1.0)
    started = time.monotonic()
    try:
        with pytest.raises(LoaderFailed) as failed:
            list(loader)
        assert time.monotonic() - started < 10
        line = str(failed.value)
        assert line.startswith("data.timeout=1: no batch from the 2 loader thread(s) in 1 s; stuck in: /mnt/gone/4.jpg")
        assert "\n" not in line and "it is left behind" in line
        loader.close()
        assert all(t.daemon for t in threading.enumerate() if t is not threading.main_thread())  # the process can exit
    finally:
        stuck.set()  # the stuck read returns, so no thread outlives the test


def test_an_error_in_a_loader_thread_reaches_the_loop_with_its_type() -> None:
    loader = _loader(_Stuck(threading.Event()), timeout=0)
    loader.sampler.set_epoch(0, start=6)  # past the stuck read: samples 6 and 7 first
    with pytest.raises(ValueError, match="a bug in __getitem__"):
        list(loader)


@pytest.mark.parametrize(
    ("overrides", "words"),
    [
        (["data.device_resident=true"], "data.engine=threads has no loader to run: data.device_resident=true"),
        (["dataset=imagefolder", "dataset.decode=cuda"], "not available with dataset.decode=cuda"),
    ],
)
def test_what_threads_cannot_run_is_one_line_before_any_data(overrides, words, tmp_path: Path) -> None:
    extra = [f"dataset.root={tmp_path}"] if "dataset=imagefolder" in overrides else []
    with pytest.raises(ConfigError, match=words):
        validate(compose_cfg("data.engine=threads", *overrides, *extra))


def test_without_torchdata_a_threads_run_ends_in_one_line(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setitem(sys.modules, "torchdata", None)
    monkeypatch.setitem(sys.modules, "torchdata.nodes", None)
    with pytest.raises(optional.MissingEngine, match=r"^data.engine=threads needs torchdata, .*'\.\[threads\]'"):
        run(compose_cfg("debug=fast", "data.engine=threads", output_dir=str(tmp_path / "run")))


@pytest.mark.slow  # three runs
def test_a_run_stopped_on_threads_resumes_on_processes_exactly(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """SIGTERM during step 5 of a threads run: saved mid-epoch; the same run continued with worker processes ends
    with the weights of one uninterrupted run on processes."""
    run(compose_cfg(*RESUMABLE, output_dir=str(tmp_path / "straight")))
    stop_after_step_5(monkeypatch, [*RESUMABLE, "data.engine=threads", "data.num_workers=2"], tmp_path / "part")
    run(compose_cfg(*RESUMABLE, output_dir=str(tmp_path / "part")))
    assert read_metrics(tmp_path / "part")["steps"] == 16
    straight = torch.load(tmp_path / "straight" / "checkpoints" / "last.pt", weights_only=True)["model"]
    resumed = torch.load(tmp_path / "part" / "checkpoints" / "last.pt", weights_only=True)["model"]
    assert all(torch.equal(straight[key], resumed[key]) for key in straight)


def _input_bound(engine: str, threads: int, cpu_share: float | None) -> dict:
    per_image = dict.fromkeys(("read", "decode", "transfer", "h2d", "gpu_decode", "collate"), 0.01) | {"augment": 0.2}
    pipeline = {"stage_ms_per_image": per_image, "worker_busy_frac": 0.95, "worker_busy_cores": 1.9}
    pipeline |= {"transfer_frac_of_wait": 0.0, "workers": threads, "loader_cpu_frac": cpu_share}
    loader = {"num_workers": threads, "pin_memory": False, "persistent_workers": False, "engine": engine}
    return {"mode": "train", "data_wait_frac": 0.6, "loader": loader, "cpu_count": 2, "world_size": 1} | {
        "device": "cpu",
        "pipeline": pipeline,
        "dataset_augment": "trivialaugment",
    }


def test_the_verdict_says_when_a_stage_will_not_scale_on_threads() -> None:
    """Loader threads on a CPU under 70% of their busy time waited for each other (the GIL) or for cores: the
    verdict says so and points at worker processes; threads that ran freely, or processes, get today's advice."""
    bound = report.verdict(_input_bound("threads", 2, 0.45))
    assert "augment takes the most input time" in bound
    assert (
        "the 2 loader threads ran on a CPU only 45% of their busy time" in bound and "data.engine=dataloader" in bound
    )
    assert report.suggest_next(_input_bound("threads", 2, 0.45)) == "data.engine=dataloader"
    assert "loader threads ran" not in report.verdict(_input_bound("threads", 2, 0.9))
    assert "loader threads ran" not in report.verdict(_input_bound("dataloader", 2, None))
    assert "persistent_workers" not in report.verdict(_input_bound("threads", 1, 0.9))  # threads start each epoch
    assert console.busy_line(_input_bound("threads", 2, 0.45)["pipeline"], "threads") == (
        "95% of 2 loader thread(s), 1.90 CPU cores, on a CPU 45% of that time"
    )


def test_a_handle_threads_must_not_share_is_named_before_the_first_batch(caplog: pytest.LogCaptureFixture) -> None:
    """A sqlite3 connection opened in a user's __init__ refuses every other thread: said before any batch."""

    class Rows(_Stuck):
        def __init__(self) -> None:
            self.db = sqlite3.connect(":memory:")

    class Wrapper(torch.utils.data.Dataset):
        def __init__(self, dataset) -> None:
            self.dataset = dataset

        def __len__(self) -> int:
            return len(self.dataset)

    assert shared_handles(Wrapper(Rows())) == ["Rows.db (sqlite3.Connection)"]
    caplog.set_level("WARNING")
    _loader(Wrapper(Rows()), timeout=0)
    assert "the dataset holds Rows.db (sqlite3.Connection), which the 2 loader threads would share" in caplog.text


def test_data_engine_tune_needs_num_workers_tune() -> None:
    with pytest.raises(ConfigError, match=r"^data.engine=tune is chosen by data.num_workers=tune's probe, and "):
        validate(compose_cfg("data.engine=tune", "data.num_workers=2"))
    assert validate(compose_cfg("data.engine=tune", "data.num_workers=tune")).data.engine == LoaderEngine.tune


def test_tune_probes_both_engines_and_keeps_the_cheaper_one_ahead(monkeypatch: pytest.MonkeyPatch) -> None:
    """Fewest workers first, then threads before processes at one count (the sweep report's tie order)."""
    keys = tune.candidates_of([0, 1, 2], LoaderEngine.tune)
    assert [key.label(engines=True) for key in keys] == [
        "num_workers=0", "num_workers=1 engine=threads", "num_workers=1 engine=dataloader",
        "num_workers=2 engine=threads", "num_workers=2 engine=dataloader",
    ]  # fmt: skip
    assert tune.candidates_of([0, 2], LoaderEngine.threads) == [tune.Candidate(0), tune.Candidate(2, False)]
    compute = Rate(100.0, (99.0, 101.0), 5)
    rates = {key: Rate(rate, (rate - 1, rate + 1), 5) for key, rate in zip(keys, (50, 200, 210, 300, 300), strict=True)}
    assert tune.choose(rates, compute)[0] == tune.Candidate(1, False)  # both ahead at 1 worker: threads
    rates[tune.Candidate(1, False)] = Rate(110.0, (109.0, 111.0), 5)  # threads behind at 1: processes
    assert tune.choose(rates, compute)[0] == tune.Candidate(1, True)
    monkeypatch.setattr(tune.optional, "missing", lambda module: module == "torchdata")
    assert tune.candidates_of([0, 1], LoaderEngine.tune) == [tune.Candidate(0), tune.Candidate(1)]


@pytest.mark.slow  # a tuned run: probes of both engines
def test_a_run_with_data_engine_tune_trains_on_the_engine_its_probe_chose(tmp_path: Path) -> None:
    run(compose_cfg("debug=fast", "data.num_workers=tune", "data.engine=tune", "data.tune_budget_s=3",
                    output_dir=str(tmp_path)))  # fmt: skip
    args = json.loads((tmp_path / "loader_args.json").read_text())
    probed = {(row["num_workers"], row["engine"]) for row in args["tune"]["table"]}
    assert (1, "threads") in probed and (1, "dataloader") in probed
    chosen = (args["tune"]["chosen"], args["tune"]["engine"])
    assert chosen in probed and (args["train"]["num_workers"], args["train"]["engine"]) == chosen


class _Counted(torch.utils.data.Dataset):
    """Counts the samples it has loaded."""

    def __init__(self) -> None:
        self.loaded = 0

    def __len__(self) -> int:
        return 16

    def __getitem__(self, index: int):
        self.loaded += 1
        return torch.zeros(3, 4, 4), index


def test_the_next_epoch_is_made_while_this_one_ends_and_a_resume_starts_afresh() -> None:
    """Epoch 1's first batches are made before the loop asks for them (no epoch-start stall), and they are the
    batches epoch 1 gives; an epoch that is not the one made ahead (a resume part-way) starts a new pipeline."""
    dataset = _Counted()
    loader = _loader(dataset, timeout=5.0)
    loader.sampler.set_epoch(0)
    first = [batch.labels.tolist() for batch in loader]
    made = dataset.loaded
    deadline = time.monotonic() + 5
    while dataset.loaded == made and time.monotonic() < deadline:
        time.sleep(0.01)
    assert dataset.loaded > made  # epoch 1 under way, unasked
    loader.sampler.set_epoch(1)
    second = [batch.labels.tolist() for batch in loader]
    fresh = _loader(_Counted(), timeout=5.0)
    fresh.sampler.set_epoch(1)
    assert second == [batch.labels.tolist() for batch in fresh] and len(first) == len(second) == 8
    loader.sampler.set_epoch(2, start=4)
    assert [batch.labels.tolist() for batch in loader] == [[4, 5], [6, 7], [8, 9], [10, 11], [12, 13], [14, 15]]
    loader.close()


def test_a_stuck_read_is_named_by_its_file_not_by_its_batch(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The thread busy longest is the one stuck, and the file it is reading is the one named (data/reads.py): here
    the second file of its batch, where the line named the batch's first three."""
    paths = []
    for i in range(8):
        Image.new("RGB", (8, 8), (30 * i, 0, 0)).save(path := tmp_path / f"{i}.png")
        paths.append(str(path))
    stuck, real = threading.Event(), reads._read_exactly

    def hung(fd: int, size: int) -> bytearray:  # a read on a dead mount, in the real read's place
        if os.readlink(f"/proc/self/fd/{fd}") == paths[5]:
            stuck.wait(30)
        return real(fd, size)

    monkeypatch.setattr(reads, "_read_exactly", hung)
    loader = _loader(ImageFileDataset(paths, [0] * 8, ["a"], lambda image: image), timeout=1.0)
    try:
        with pytest.raises(LoaderFailed) as failed:
            list(loader)
        assert f"; stuck in: {paths[5]} (a thread stuck" in str(failed.value)
        loader.close()
    finally:
        stuck.set()
