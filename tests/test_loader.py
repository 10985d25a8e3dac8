"""Normalisation of the DataLoader arguments: sweeps over num_workers must never crash."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import numpy as np
import pytest
import torch
from helpers import compose_cfg
from torch.utils.data import DistributedSampler, TensorDataset

from imgtrain.config.data import DataConfig
from imgtrain.config.validate import validate
from imgtrain.data import loader as loader_module
from imgtrain.data.loader import auto_num_workers, init_worker, plan_loader
from imgtrain.data.pipeline import RunData, build_loader
from imgtrain.data.samplers import EpochSampler, ShardSampler, sample_seed, sample_seeds
from imgtrain.host import dist
from imgtrain.host.cpus import CpuBudget
from imgtrain.host.dist import DistInfo


def _dataset(n: int = 64) -> TensorDataset:
    return TensorDataset(torch.arange(n).view(n, 1).float(), torch.arange(n) % 4)


@pytest.mark.slow  # slow: the fast suite's budget (make test <= 120 s on 2 cores); CI runs it in make test-slow
@pytest.mark.parametrize("workers", [0, 1])  # 1: one spawned process importing torch (each ~3 s on 2 busy cores)
def test_worker_only_options_are_dropped_at_zero_workers(workers: int) -> None:
    data = DataConfig(
        num_workers=workers,
        batch_size=16,
        prefetch_factor=4,
        persistent_workers=True,
        timeout=60,  # seconds; spawn workers import torch first, which is slow on a busy 2-core machine
        multiprocessing_context="spawn" if workers else "fork",
    )
    plan = plan_loader(data, train=True, device_type="cpu")
    if workers == 0:
        for key in ("prefetch_factor", "persistent_workers", "multiprocessing_context"):
            assert key not in plan.kwargs
        assert plan.kwargs["timeout"] == 0
        assert len(plan.notes) == 2  # pin_memory on CPU, and one line for every worker-only option
        assert "data.prefetch_factor=4" in plan.notes[1] and "data.persistent_workers=true" in plan.notes[1]
    else:
        assert plan.kwargs["prefetch_factor"] == 4 and plan.kwargs["persistent_workers"] is True
        assert plan.kwargs["multiprocessing_context"] == "spawn"
    loader = build_loader(_dataset(), plan, train=True, seed=0)
    assert sum(len(batch.labels) for batch in loader) == 64  # it really iterates, workers or not


def test_pin_memory_is_turned_off_without_cuda() -> None:
    plan = plan_loader(DataConfig(num_workers=0, pin_memory=True), train=True, device_type="cpu")
    assert plan.kwargs["pin_memory"] is False
    plan = plan_loader(DataConfig(num_workers=0, pin_memory=True), train=True, device_type="cuda")
    assert plan.kwargs["pin_memory"] is True


def test_val_loader_keeps_every_sample_and_doubles_the_batch() -> None:
    plan = plan_loader(DataConfig(num_workers=0, batch_size=10), train=False, device_type="cpu")
    assert plan.kwargs["drop_last"] is False and plan.kwargs["shuffle"] is False
    assert plan.kwargs["batch_size"] == 20
    loader = build_loader(_dataset(65), plan, train=False, seed=0)
    assert sum(len(batch.labels) for batch in loader) == 65


@pytest.mark.parametrize(
    ("cpus", "local_world", "expected"),
    [(1, 1, 0), (2, 1, 1), (16, 1, 15), (16, 2, 7), (16, 8, 1), (64, 1, 16), (2, 4, 0)],
)
def test_auto_workers_share_the_cpus(cpus: int, local_world: int, expected: int) -> None:
    assert auto_num_workers(local_world, cpus=cpus) == expected


@pytest.mark.parametrize(
    ("device", "pin", "gpu_decode", "workers", "threads"),
    [
        ("cpu", True, False, 15, "1 core(s) kept for the training thread)"),
        ("cuda", False, False, 15, "1 core(s) kept for the training thread)"),
        ("cuda", True, False, 14, "2 core(s) kept for the training thread and the pin-memory thread)"),
        ("cuda", True, True, 13, "3 core(s) kept for the training thread, the pin-memory thread and the GPU decode"),
    ],
)
def test_auto_leaves_the_training_process_threads_their_cores(monkeypatch, device, pin, gpu_decode, workers, threads):
    """On a GPU the training process runs the launching thread, the pin-memory thread and, with dataset.decode=cuda,
    the decode thread: auto leaves each a core of the 16, and the verdict's next setting stays within that."""
    monkeypatch.setattr(loader_module, "cpu_budget", lambda: CpuBudget(affinity=16, quota=None))
    data = DataConfig(num_workers="auto", pin_memory=pin)
    plan = plan_loader(data, train=True, device_type=device, gpu_decode=gpu_decode)
    assert plan.kwargs["num_workers"] == workers and plan.describe()["cores_kept"] == 16 - workers
    assert threads in plan.notes[0], plan.notes


def test_auto_workers_note_says_how_it_was_chosen() -> None:
    plan = plan_loader(DataConfig(num_workers="auto"), train=True, device_type="cpu", local_world_size=1)
    assert plan.kwargs["num_workers"] == auto_num_workers(1)
    assert any("num_workers=auto ->" in note and "CPUs available" in note for note in plan.notes)


def test_distributed_sampler_auto_follows_world_size() -> None:
    single = plan_loader(DataConfig(num_workers=0, batch_size=8), train=True, device_type="cpu", world_size=1)
    multi = plan_loader(DataConfig(num_workers=0, batch_size=8), train=True, device_type="cpu", world_size=2)
    forced = plan_loader(DataConfig(num_workers=0, distributed_sampler=True), train=True, device_type="cpu")
    assert not single.use_distributed_sampler and multi.use_distributed_sampler and forced.use_distributed_sampler
    loaders = [build_loader(_dataset(), multi, train=True, seed=0, rank=r, world_size=2) for r in range(2)]
    assert all(isinstance(loader.sampler, DistributedSampler) for loader in loaders)
    seen = [torch.cat([batch.images for batch in loader]).view(-1).tolist() for loader in loaders]
    assert not set(seen[0]) & set(seen[1]) and len(seen[0]) + len(seen[1]) == 64


def test_ranks_see_disjoint_samples_covering_the_dataset_every_epoch() -> None:
    plan = plan_loader(DataConfig(num_workers=0, batch_size=4), train=True, device_type="cpu", world_size=2)
    loaders = [build_loader(_dataset(), plan, train=True, seed=0, rank=r, world_size=2) for r in range(2)]
    orders = []
    for epoch in range(2):
        for loader in loaders:
            loader.sampler.set_epoch(epoch)  # as the training loop does every epoch
        seen = [torch.cat([batch.images for batch in loader]).view(-1).int().tolist() for loader in loaders]
        assert not set(seen[0]) & set(seen[1])
        assert sorted(seen[0] + seen[1]) == list(range(64))
        orders.append(seen[0])
    assert orders[0] != orders[1]  # set_epoch reshuffles


def test_shard_sampler_counts_each_sample_once() -> None:
    shards = [list(ShardSampler(10, rank, 3)) for rank in range(3)]
    assert sorted(i for shard in shards for i in shard) == list(range(10))


def test_same_seed_same_order() -> None:
    plan = plan_loader(DataConfig(num_workers=0, batch_size=8), train=True, device_type="cpu")
    loaders = [build_loader(_dataset(), plan, train=True, seed=s) for s in (1, 1, 2)]
    orders = [[batch.images.view(-1).tolist() for batch in loader] for loader in loaders]
    assert orders[0] == orders[1] and orders[0] != orders[2]


def test_init_worker_seeds_numpy_and_random() -> None:
    import random
    import signal

    import numpy as np

    saved = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2)}
    try:
        torch.manual_seed(1234)
        init_worker(0)
        first = (np.random.rand(), random.random())
        torch.manual_seed(1234)
        init_worker(0)
        assert (np.random.rand(), random.random()) == first
        assert signal.getsignal(signal.SIGUSR1) == signal.SIG_IGN  # a job-wide SIGUSR1 must not kill workers
    finally:
        for signum, handler in saved.items():
            signal.signal(signum, handler)


def test_describe_is_json_friendly() -> None:
    import json

    plan = plan_loader(DataConfig(num_workers=2), train=True, device_type="cpu")
    described = json.loads(json.dumps(plan.describe()))
    assert described["num_workers"] == 2 and described["seed_workers"] is True
    assert "worker_init_fn" not in described


def test_worker_seeding_makes_augmentation_reproducible(tmp_path) -> None:
    from imgtrain.data.datasets import build_shapes

    bundle = build_shapes("shapes", 32, [0.5] * 3, [0.25] * 3, True, str(tmp_path), 40, 10, 0)
    plan = plan_loader(DataConfig(num_workers=2, batch_size=8, persistent_workers=False), train=True, device_type="cpu")

    def first_batches(seed: int) -> torch.Tensor:
        loader = build_loader(bundle.train, plan, train=True, seed=seed)
        return torch.cat([batch.images for batch in loader])

    assert torch.equal(first_batches(7), first_batches(7))  # same seed: same crops and flips in the workers
    assert not torch.equal(first_batches(7), first_batches(8))


@pytest.mark.parametrize("workers", [0, 2])
def test_in_order_false_reaches_the_dataloader_when_there_are_workers(workers: int) -> None:
    """data.in_order=false: the DataLoader may hand over a batch a worker finished early. Left out when true (torch's
    default; torch < 2.6 has no such argument) and with no workers, where one process reads in order anyway."""
    assert "in_order" not in plan_loader(DataConfig(num_workers=2), train=True, device_type="cpu").kwargs
    data = DataConfig(num_workers=workers, batch_size=16, in_order=False, persistent_workers=False)
    plan = plan_loader(data, train=True, device_type="cpu")
    loader = build_loader(_dataset(), plan, train=True, seed=0)
    if workers:
        assert plan.kwargs["in_order"] is False and loader.in_order is False and plan.describe()["in_order"] is False
    else:
        assert "in_order" not in plan.kwargs and "data.in_order=false" in plan.notes[-1]
    assert sorted(label for batch in loader for label in batch.labels.tolist()) == sorted([0, 1, 2, 3] * 16)


def test_a_mid_epoch_resume_out_of_order_says_what_it_may_repeat(caplog: pytest.LogCaptureFixture) -> None:
    data = DataConfig(num_workers=1, batch_size=16, in_order=False, persistent_workers=False)
    loader = build_loader(_dataset(), plan_loader(data, train=True, device_type="cpu"), train=True, seed=0)
    run_data = RunData(bundle=None, settings=data, info=DistInfo(), device_type="cpu", seed=0, train=loader)
    run_data.start_epoch(1, samples_done=0)
    assert not caplog.records  # a fresh epoch is in order by construction
    run_data.start_epoch(1, samples_done=32)
    assert "num_workers x prefetch_factor batches of it are repeated" in caplog.text and len(caplog.records) == 1
    assert len(loader) == 2  # still resumed by position: the 2 batches after the first 32 samples


def test_dataset_shards_keeps_worker_order(caplog: pytest.LogCaptureFixture) -> None:
    """LitData's resume state counts batches per worker in round-robin order: in_order=false is dropped, said once."""
    settings = validate(compose_cfg("data.in_order=false", "data.num_workers=2"))
    run_data = RunData(None, settings.data, DistInfo(), "cpu", seed=0, streamed=True)
    train, val = run_data.train_plan(), run_data.val_plan()
    assert "in_order" not in train.kwargs and val.kwargs["in_order"] is False  # validation has no resume state
    assert "does not apply to dataset=shards" in caplog.text


def test_augmentation_does_not_depend_on_the_worker_count(tmp_path) -> None:
    """Each sample's crop and flip come from its own seed: a num_workers sweep changes speed, not the math."""
    from imgtrain.data.datasets import build_shapes

    bundle = build_shapes("shapes", 32, [0.5] * 3, [0.25] * 3, True, str(tmp_path), 40, 10, 0)

    def epoch_images(workers: int, epoch: int) -> torch.Tensor:
        data = DataConfig(num_workers=workers, batch_size=8, persistent_workers=False)
        loader = build_loader(bundle.train, plan_loader(data, train=True, device_type="cpu"), train=True, seed=3)
        loader.sampler.set_epoch(epoch)
        return torch.cat([batch.images for batch in loader])

    reference = epoch_images(0, 0)
    assert torch.equal(reference, epoch_images(1, 0)) and torch.equal(reference, epoch_images(2, 0))
    assert not torch.equal(reference, epoch_images(0, 1))  # a new epoch: a new order and new augmentations


@pytest.mark.parametrize(("world_size", "consumed"), [(1, 0), (1, 24), (2, 16), (2, 48), (3, 18)])
def test_epoch_sampler_resumes_exactly_where_it_stopped(world_size: int, consumed: int) -> None:
    """Skipping `consumed` samples (a whole number of global batches) gives the rest of the same epoch."""

    def shards(start: int) -> list[list[tuple[int, int]]]:
        out = []
        for rank in range(world_size):
            sampler = EpochSampler(50, num_replicas=world_size, rank=rank, shuffle=True, seed=5, drop_last=True)
            sampler.set_epoch(2, start=start // world_size)
            out.append(list(sampler))
        return out

    full, resumed = shards(0), shards(consumed)
    for rank in range(world_size):
        assert resumed[rank] == full[rank][consumed // world_size :]
        assert len(resumed[rank]) == len(full[rank]) - consumed // world_size
    seeds = [seed for shard in full for _, seed in shard]
    assert len(set(seeds)) == len(seeds)  # every sample of the epoch has its own augmentation seed


def _splitmix_reference(seed: int, epoch: int, index: int) -> int:
    """The per-sample seed as first written, in plain Python integers: the NumPy version must agree."""
    mask = (1 << 64) - 1
    x = (seed * 0x9E3779B97F4A7C15 + epoch * 0xD1B54A32D192ED03 + index) & mask
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & mask
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & mask
    return (x ^ (x >> 31)) >> 1


def test_per_sample_seeds_are_computed_with_numpy_and_match_the_hash() -> None:
    indices = np.array([0, 1, 2, 49_999, 2**40], dtype=np.int64)
    for seed, epoch in ((0, 0), (7, 3), (2**31 - 1, 1000)):
        expected = [_splitmix_reference(seed, epoch, int(i)) for i in indices]
        assert sample_seeds(seed, epoch, indices).tolist() == expected
        assert [sample_seed(seed, epoch, int(i)) for i in indices] == expected  # the one-sample form (shards)
    sampler = EpochSampler(50, num_replicas=2, rank=1, shuffle=True, seed=4, drop_last=True)
    sampler.set_epoch(2, start=5)
    order, seeds = sampler.order()
    assert list(sampler) == [(int(i), _splitmix_reference(4, 2, int(i))) for i in order]
    assert len(order) == len(sampler) == 20 and seeds.dtype == np.int64


@pytest.mark.parametrize(
    ("setting", "process_group", "expected"),
    [(None, False, None), (None, True, "forkserver"), ("fork", True, "fork"), ("spawn", False, "spawn")],
)
def test_workers_start_by_forkserver_under_a_process_group_unless_set(setting, process_group, expected) -> None:
    """Under torchrun, gloo threads make fork unsafe (see data/loader.py): null means forkserver there, with a note;
    an explicit setting is kept, and a single process keeps the platform's default."""
    data = DataConfig(num_workers=2, multiprocessing_context=setting)
    plan = plan_loader(data, train=True, device_type="cpu", world_size=2, process_group=process_group)
    assert plan.kwargs["multiprocessing_context"] == expected
    assert any("forkserver under a process group" in note for note in plan.notes) == (setting is None and process_group)


# Two epochs of a forkserver loader with persistent workers; between them the process waits for SIGTERM.
_SIGNALLED_LOADER = """
import signal, sys, time, torch
from torch.utils.data import TensorDataset
from imgtrain.config.data import DataConfig
from imgtrain.data.failures import stop_workers
from imgtrain.data.loader import plan_loader
from imgtrain.data.pipeline import build_loader
got = []
signal.signal(signal.SIGTERM, lambda *_: got.append(1))
plan = plan_loader(DataConfig(num_workers=1, batch_size=4), train=True, device_type="cpu", process_group=True)
loader = build_loader(TensorDataset(torch.zeros(16, 1), torch.zeros(16, dtype=torch.long)), plan, train=True, seed=0)
print("epoch 1:", sum(1 for _ in loader), "batches", flush=True)
while not got:
    time.sleep(0.01)
print("epoch 2:", sum(1 for _ in loader), "batches", flush=True)
stop_workers(loader._iterator)  # as a run does at its end: left to exit, the worker would take its 30 s grace
"""


@pytest.mark.slow  # two epochs of a forkserver loader around a real SIGTERM (make test stays under 150 s)
def test_a_forkserver_and_its_workers_outlive_sigterm_to_the_process_group() -> None:
    """torchrun's agent and SLURM signal the whole process group: the rank saves at its next agreed step, so its
    workers must go on serving batches. A forkserver killed by that SIGTERM made them look dead (CI, 2026-11-24)."""
    proc = subprocess.Popen(
        [sys.executable, "-c", _SIGNALLED_LOADER],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,  # its own process group, as torchrun gives each rank
    )
    try:
        assert proc.stdout.readline() == "epoch 1: 4 batches\n"
        os.killpg(proc.pid, signal.SIGTERM)
        output, _ = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 0 and output == "epoch 2: 4 batches\n", output[-2000:]


def test_a_stop_signal_pending_while_a_worker_starts_does_not_end_it() -> None:
    """A forkserver's worker starts with the stop signals blocked; a Ctrl-C that arrived meanwhile is pending.
    worker_signals must install its handlers before it unblocks them: the worker lives on (with its grace alarm)
    instead of quitting with KeyboardInterrupt, which the main process would report as a dead worker."""
    code = (
        "import signal, threading\n"
        "from imgtrain.data.loader import SHIELDED_SIGNALS, worker_signals\n"
        "signal.pthread_sigmask(signal.SIG_BLOCK, SHIELDED_SIGNALS)\n"
        # to this thread: sent to the process, torch's own threads (not blocking it) could take it at once
        "signal.pthread_kill(threading.get_ident(), signal.SIGINT)\n"
        "worker_signals()\n"
        "for _ in range(1000): pass  # the pending signal's Python handler runs here\n"
        "print('alive, alarm', signal.alarm(0))\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0 and "KeyboardInterrupt" not in result.stderr, result.stderr
    assert result.stdout.startswith("alive, alarm ") and int(result.stdout.split()[-1]) > 0


def test_every_plan_of_a_run_comes_from_its_run_data(monkeypatch: pytest.MonkeyPatch, caplog) -> None:
    """dataset=shards under DDP: the ranks agree on rank 0's worker count before the one training plan is made
    (no plan made, then made again), and its adjustments are said once, whatever plans follow (tune's probes)."""
    settings = validate(compose_cfg("data.num_workers=3", "data.drop_last=false"))
    two_ranks = DistInfo(rank=1, local_rank=1, world_size=2, local_world_size=2)
    sent = []
    monkeypatch.setattr(dist, "broadcast_plain", lambda value, info: sent.append(value) or 1)  # rank 0 has 1
    data = RunData(None, settings.data, two_ranks, "cpu", seed=0, streamed=True)
    assert caplog.text.count("does not apply to dataset=shards") == 1  # drop_last=false, said once
    workers = data.agreed_workers()
    assert sent == [3] and workers == 1 and "data.num_workers=1 on every rank, rank 0's" in caplog.text
    plans = [data.train_plan(workers), data.train_plan(2)]  # the agreed count, then e.g. a tune probe's
    assert [p.kwargs["num_workers"] for p in plans] == [1, 2] and all(p.kwargs["drop_last"] for p in plans)
    assert caplog.text.count("does not apply to dataset=shards") == 1
    assert data.val_plan().kwargs["drop_last"] is False  # validation keeps every sample
    local = RunData(None, settings.data, DistInfo(), "cpu", seed=0, streamed=True)
    assert local.agreed_workers() is None and sent == [3]  # one rank, or a folder: nothing to agree on
