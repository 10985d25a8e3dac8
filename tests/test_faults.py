"""DataLoader failures explained, stop signals recorded, and faults agreed at logging windows, not every step."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
import torch
from helpers import FAST, ROOT, compose_cfg
from test_reads import unblocked
from torch.utils.data import Dataset

from imgtrain.common.errors import RunError
from imgtrain.config.data import DataConfig
from imgtrain.config.faults import NonFinite
from imgtrain.data.failures import (
    LoaderTimedOut,
    explain_loader_failure,
    next_batch,
    worker_deaths_found_at_next_batch,
    workers_stopped_on_error,
)
from imgtrain.data.loader import plan_loader
from imgtrain.data.pipeline import build_loader
from imgtrain.data.samples import GuardedSamples, collate
from imgtrain.resilience.agreement import WindowReport, exchange, merge
from imgtrain.resilience.faults import SECOND_CTRL_C_AFTER_S, Faults, Preempted, Stop, StopReason, StopSignals
from imgtrain.train import loop
from imgtrain.train.run import run


class _Faulty(Dataset):
    """Item 0 of the epoch makes the worker die by `signum`, or hang for `sleep_s`."""

    def __init__(self, signum: int = 0, sleep_s: float = 0.0) -> None:
        self.signum, self.sleep_s = signum, sleep_s

    def __len__(self) -> int:
        return 8

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        if self.signum:
            os.kill(os.getpid(), self.signum)
            time.sleep(5)
        if self.sleep_s:
            time.sleep(self.sleep_s)
        return torch.zeros(3, 4, 4, dtype=torch.uint8), 0


def _first_batch(dataset: Dataset, **data: object) -> None:
    settings = DataConfig(num_workers=1, batch_size=4, persistent_workers=False, **data)
    loader = build_loader(dataset, plan_loader(settings, train=True, device_type="cpu"), train=True, seed=0)
    next_batch(iter(loader), settings)


@pytest.mark.parametrize(
    ("signum", "expected"),
    [
        (signal.SIGBUS, ["Bus error", "/dev/shm", "--shm-size", "data.num_workers"]),
        (signal.SIGKILL, ["Killed", "out-of-memory", "data.num_workers", "data.persistent_workers=false"]),
        (signal.SIGSEGV, ["Segmentation fault", "data.num_workers=0"]),
    ],
)
def test_a_crashed_worker_gets_a_cause_and_a_setting(
    signum: int, expected: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Found at once by PyTorch's SIGCHLD handler, as in a fresh process: an in-process run earlier in the same
    pytest process leaves SIGCHLD at its default (worker_deaths_found_at_next_batch), and PyTorch sets its handler
    once a process, so each case would wait out PyTorch's 5 s status check (the test below takes that path once)."""
    monkeypatch.setattr(torch.utils.data._utils.signal_handling, "_SIGCHLD_handler_set", False)
    previous = signal.getsignal(signal.SIGCHLD)
    try:
        with pytest.raises(RunError) as caught:
            _first_batch(_Faulty(signum=signum))
    finally:
        signal.signal(signal.SIGCHLD, previous)
    _assert_one_line_with(str(caught.value), expected)


@pytest.mark.slow  # slow: the fast suite's budget (make test <= 120 s on 2 cores); CI runs it in make test-slow
def test_a_worker_killed_during_an_epoch_is_found_by_the_next_batch_and_explained(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A run's path (SIGCHLD at its default during an epoch, PyTorch's handler set before it): PyTorch's status
    check, every 5 s, finds the dead worker, and the message is the same as above."""
    monkeypatch.setattr(torch.utils.data._utils.signal_handling, "_SIGCHLD_handler_set", True)  # not set again here
    with worker_deaths_found_at_next_batch(), pytest.raises(RunError) as caught:
        _first_batch(_Faulty(signum=signal.SIGKILL))
    _assert_one_line_with(str(caught.value), ["Killed", "out-of-memory", "data.num_workers"])


@pytest.mark.slow  # about 10 s: a 2-epoch run, and PyTorch's 5 s status check as the second epoch starts
def test_a_worker_killed_while_the_epoch_ends_is_found_as_the_next_starts_in_one_line_saved(
    tmp_path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The persistent training worker killed (as the OOM killer does) while the first epoch's end validates and
    saves. PyTorch's SIGCHLD handler, set as the workers started, was back in place there and raised in the main
    thread wherever it was: a traceback from inside the checkpoint's copy (found by CI, test_resilience's SIGKILL
    test under load). Now the next epoch's start finds it: one line, the last step saved."""
    monkeypatch.setattr(torch.utils.data._utils.signal_handling, "_SIGCHLD_handler_set", False)  # as in a new process
    previous = signal.getsignal(signal.SIGCHLD)
    validate = loop.evaluate

    def killed_first(model, data, *args):
        if data.train._iterator is not None and data.train._iterator._workers[0].is_alive():
            data.train._iterator._workers[0].kill()
            time.sleep(1.0)  # SIGCHLD arrives here: PyTorch's handler would raise now
        return validate(model, data, *args)

    monkeypatch.setattr(loop, "evaluate", killed_first)
    run_dir = tmp_path / "run"
    try:
        with pytest.raises(RunError) as caught:
            run(
                compose_cfg(
                    *FAST, "train.epochs=2", "dataset.num_train=64", "dataset.num_val=32", output_dir=str(run_dir)
                )
            )
    finally:
        signal.signal(signal.SIGCHLD, previous)
    _assert_one_line_with(str(caught.value), ["exited unexpectedly", "killed by signal: Killed", "(step 2)"])
    assert torch.load(run_dir / "checkpoints" / "last.pt", weights_only=True)["progress"]["step"] == 2


def _assert_one_line_with(message: str, parts: list[str]) -> None:
    assert "\n" not in message
    for part in parts:
        assert part in message, message


@pytest.mark.slow  # about 10 s: the worker must outlive data.timeout
def test_data_timeout_turns_a_stuck_worker_into_an_error() -> None:
    with pytest.raises(RunError, match=r"timed out after 1 seconds: data.timeout=1 s passed without a batch"):
        _first_batch(_Faulty(sleep_s=2.5), timeout=1)


def test_other_errors_pass_through() -> None:
    assert explain_loader_failure("CUDA error: out of memory", DataConfig()) is None


def test_a_full_shm_raised_in_a_worker_is_explained() -> None:
    """What torch 2.15 said when 8 batches of 9.8 MB met a 64 MB /dev/shm (a real run, docs/troubleshooting.md)."""
    message = (
        "Caught RuntimeError in DataLoader worker process 0.\nOriginal Traceback (most recent call last):\n"
        '  File "torch/storage.py", line 423, in _new_shared\n    return cls._new_using_fd_cpu(size)\n'
        "RuntimeError: unable to allocate shared memory(shm) for file </torch_15171_858738049_6>: "
        "No space left on device (28)"
    )
    explained = explain_loader_failure(message, DataConfig())
    assert explained.startswith("RuntimeError: unable to allocate shared memory(shm)") and "--shm-size" in explained
    assert explain_loader_failure("Caught KeyError in DataLoader worker process 0.\nKeyError: 3", DataConfig()) is None


def test_unreadable_images_are_replaced_and_reported(tmp_path) -> None:
    from imgtrain.data.datasets import build_shapes

    bundle = build_shapes("shapes", 32, [0.5] * 3, [0.25] * 3, False, str(tmp_path), 20, 10, 0)
    broken = bundle.train.path(1)
    with open(broken, "wb") as f:
        f.write(b"\xff\xd8 truncated jpeg")
    samples = GuardedSamples(bundle.train)
    image, label, skipped, _ = samples[1]
    assert len(skipped) == 1 and skipped[0][0] == broken and skipped[0][1]  # (path, reason)
    assert torch.equal(image, samples[2][0]) and label == samples[2][1]  # the next readable sample
    batch = collate([samples[0], samples[1]])
    assert batch.images.shape[0] == 2 and batch.skipped == skipped


def test_validation_drops_unreadable_images_instead_of_counting_a_neighbour_twice(tmp_path) -> None:
    from imgtrain.data.datasets import build_shapes

    bundle = build_shapes("shapes", 32, [0.5] * 3, [0.25] * 3, False, str(tmp_path), 20, 10, 0)
    broken = bundle.val.path(1)
    with open(broken, "wb") as f:
        f.write(b"\xff\xd8 truncated jpeg")
    samples = GuardedSamples(bundle.val, replace=False)
    assert samples[1][0] is None and samples[1][2][0][0] == broken
    batch = collate([samples[0], samples[1], samples[2]])
    assert batch.images.shape[0] == 2 and batch.labels.tolist() == [samples[0][1], samples[2][1]]
    assert batch.skipped == samples[1][2]
    nothing = collate([samples[1]])  # a batch of only unreadable files: no images, no labels
    assert nothing.images is None and nothing.labels.shape == (0,) and len(nothing.skipped) == 1


def test_stop_signals_are_recorded_then_restored() -> None:
    before = signal.getsignal(signal.SIGUSR1)
    with StopSignals() as signals:
        os.kill(os.getpid(), signal.SIGUSR1)
        time.sleep(0.1)  # the handler runs in the main thread between bytecodes
        assert signals.received == signal.SIGUSR1
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.1)
        assert signals.received == signal.SIGUSR1  # the first one wins
    assert signal.getsignal(signal.SIGUSR1) == before


def test_a_second_ctrl_c_exits_at_once_naming_the_last_checkpoint(monkeypatch: pytest.MonkeyPatch) -> None:
    """The first Ctrl-C asks for a save; the second leaves now (os._exit: no traceback, no cleanup that could
    hang), with one line naming what is on disk."""
    lines: list[bytes] = []
    monkeypatch.setattr(os, "write", lambda fd, data: lines.append(data) or len(data))
    monkeypatch.setattr(os, "_exit", lambda code: (_ for _ in ()).throw(SystemExit(code)))
    signals = StopSignals()
    signals.last_checkpoint = lambda: "The last good checkpoint is run/checkpoints/last.pt (step 6)."
    signals._record(signal.SIGINT, None)
    assert signals.received == signal.SIGINT and b"Ctrl-C again to exit at once" in lines[-1]
    signals._record(signal.SIGTERM, None)  # another stop signal meanwhile changes nothing
    signals._record(signal.SIGINT, None)  # the same Ctrl-C again at once (torchrun's agent forwards it): no exit
    signals._first_at -= SECOND_CTRL_C_AFTER_S  # a second press, later
    with pytest.raises(SystemExit) as exited:
        signals._record(signal.SIGINT, None)
    assert exited.value.code == 130
    assert lines[-1].decode() == (
        "[imgtrain] second Ctrl-C: exiting now, without saving. The last good checkpoint is "
        "run/checkpoints/last.pt (step 6).\n"
    )


def test_hand_over_runs_a_schedulers_own_handler() -> None:
    """submitit installs a SIGUSR2 handler that requeues; it must still run, after our checkpoint."""
    calls = []
    previous = signal.signal(signal.SIGUSR2, lambda signum, frame: calls.append(signum))
    try:
        with StopSignals() as signals:
            os.kill(os.getpid(), signal.SIGUSR2)
            time.sleep(0.1)
            assert signals.received == signal.SIGUSR2 and not calls
            signals.hand_over(signal.SIGUSR2)
        assert calls == [signal.SIGUSR2]
    finally:
        signal.signal(signal.SIGUSR2, previous)


def _faults(policy: NonFinite, budget: int | None = 10) -> Faults:
    return Faults(policy, budget, torch.device("cpu"))


def _window(faults: Faults, *others: WindowReport) -> None:
    """A logging window: this rank's report and `others` (other ranks'), merged as the exchange merges them."""
    faults.agree(merge([WindowReport(**faults.report()), *others]))


def test_nonfinite_skip_reads_the_loss_every_step_and_stop_waits_for_a_window() -> None:
    skip = _faults(NonFinite.skip)
    assert not skip.allows_update(torch.tensor(float("nan")), 3) and skip.counts.nonfinite_steps == 1
    assert skip.allows_update(torch.tensor(1.5), 4)
    stop = _faults(NonFinite.stop)  # no read per step: the first bad step is kept on the device
    assert stop.allows_update(torch.tensor(1.0), 1) and stop.allows_update(torch.tensor(float("inf")), 2)
    assert stop.allows_update(torch.tensor(float("nan")), 3)
    assert stop.stop() is None  # not agreed yet
    _window(stop)
    assert stop.stop() == Stop(StopReason.NONFINITE) and stop.first_nan == 2
    assert "NaN or infinite at step 2 (epoch 1)" in str(stop.nonfinite_error(0, "No checkpoint had been written yet."))


def test_faults_stop_only_on_what_the_window_agreed() -> None:
    faults = _faults(NonFinite.stop, budget=2)
    faults.unreadable((("a.jpg", "truncated"), ("b.jpg", "truncated")))
    assert faults.stop() is None and faults.counts.skipped_samples == 0  # nothing agreed yet
    _window(faults, WindowReport(unreadable=1))  # this rank's two, and another rank's one
    assert faults.counts.skipped_samples == 3 and faults.stop() == Stop(StopReason.BAD_DATA)
    assert "data.max_bad_samples=2 exceeded: 3 image reads failed" in str(faults.bad.error("saved"))
    signalled = _faults(NonFinite.stop)
    signalled.alone = False  # under DDP: a signal that reached one rank counts once agreed
    _window(signalled, WindowReport(stop_signal=signal.SIGTERM))  # a signal reached rank 1 only
    assert signalled.stop() == Stop(StopReason.SIGNAL, signal.SIGTERM)
    failed = _faults(NonFinite.stop)
    _window(failed, WindowReport(write_failed=True, stop_signal=signal.SIGTERM))  # no save to try: say why
    assert failed.stop() == Stop(StopReason.WRITE_FAILED)


def test_agreement_merges_every_ranks_report_and_survives_the_float_exchange() -> None:
    reports = [
        WindowReport(images_per_sec=100.0, data_wait_frac=0.1, step_time_ms=20.0, gpu_util_pct=-1.0, first_nan_step=7),
        WindowReport(images_per_sec=80.0, data_wait_frac=0.3, step_time_ms=25.0, gpu_util_pct=50.0, first_nan_step=5),
        WindowReport(stop_signal=signal.SIGINT, unreadable=2, checkpoint_due=True),
    ]
    agreed = merge(reports)
    assert agreed.images_per_sec == 180.0 and agreed.data_wait_frac_max == 0.3 and agreed.step_time_ms == 25.0
    assert agreed.gpu_util_per_rank == [None, 50.0, None] and agreed.first_nan_step == 5
    assert agreed.stop_signal == signal.SIGINT and agreed.unreadable == 2 and agreed.checkpoint_due
    assert not agreed.write_failed
    assert exchange(reports[2]) == merge([reports[2]])  # one process: its own report, typed back from floats


def test_preempted_exit_code_follows_the_shell_convention() -> None:
    assert Preempted(signal.SIGTERM, "x").code == 143
    assert Preempted(signal.SIGUSR1, "x").code == 138
    assert Preempted(signal.SIGINT, "x").line == "stopped: x"


class _OpensAFifo(Dataset):
    """A dataset of the user's that opens its files itself: one is a FIFO, whose open waits for a writer."""

    def __init__(self, fifo: str) -> None:
        self.fifo = fifo

    def __len__(self) -> int:
        return 8

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        with open(self.fifo, "rb"):
            return torch.zeros(3, 4, 4, dtype=torch.uint8), 0


def test_a_worker_stuck_in_an_open_is_stopped_without_waiting_for_it(tmp_path) -> None:
    """data.timeout's line comes, and the stuck worker is gone with it: it would outlive the SIGTERM of PyTorch's
    shutdown by WORKER_GRACE_S (a job-wide stop's grace), which the shutdown waited 10 s for and the process's
    exit up to 30 s more. The loop's order: SIGCHLD quiet while the workers stop."""
    os.mkfifo(fifo := tmp_path / "x.jpg")
    settings = DataConfig(num_workers=1, batch_size=4, persistent_workers=False, timeout=1)
    plan = plan_loader(settings, train=True, device_type="cpu")
    loader = build_loader(_OpensAFifo(str(fifo)), plan, train=True, seed=0)
    with unblocked(fifo):
        started = time.monotonic()
        batches = iter(loader)
        workers = list(batches._workers)
        with (
            pytest.raises(LoaderTimedOut, match="data.timeout=1 s passed without a batch"),
            worker_deaths_found_at_next_batch(),
            workers_stopped_on_error(batches),
        ):
            next_batch(batches, settings)
        assert time.monotonic() - started < 8  # the timeout, the worker's start, and no wait for it
        assert not any(worker.is_alive() for worker in workers)


STUCK_DATASET = """
import torch
from torch.utils.data import Dataset


class Stuck(Dataset):
    classes = ["a", "b"]

    def __init__(self, split, fifo):
        self.fifo = fifo

    def __len__(self):
        return 64

    def __getitem__(self, index):
        if index == 20:  # a path its code opens that is a FIFO: the open waits for a writer
            with open(self.fifo, "rb") as f:
                f.read()
        return torch.full((3, 32, 32), index, dtype=torch.uint8), index % 2
"""


@pytest.mark.slow  # a train.py run: about a minute on 2 busy cores
def test_a_run_stopped_by_data_timeout_exits_promptly_after_its_line(tmp_path) -> None:
    """The whole process: the line, the checkpoint, and the exit within seconds of the line (25.8 s after it
    before, when the worker stuck in an open outlived the shutdown's SIGTERM by its grace)."""
    (tmp_path / "stuck_dataset.py").write_text(STUCK_DATASET)
    os.mkfifo(fifo := tmp_path / "x.jpg")
    args = ["dataset=custom", "dataset._target_=stuck_dataset.Stuck", f"+dataset.fifo={fifo}", "data.timeout=3"]
    args += ["dataset.image_size=32", "data.batch_size=4", "data.num_workers=1", "data.persistent_workers=false"]
    args += ["train.epochs=1", "metrics.compute_probe=false", f"hydra.run.dir={tmp_path / 'run'}"]
    env = {**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    env["PYTHONUNBUFFERED"] = "1"
    with unblocked(fifo, after_s=120):
        proc = subprocess.Popen(
            [sys.executable, str(ROOT / "train.py"), *args], cwd=ROOT, env=env, stderr=subprocess.PIPE, text=True
        )
        line = next((text for text in proc.stderr if text.startswith("error: ")), "")
        seen = time.monotonic()
        proc.wait(timeout=120)
    assert time.monotonic() - seen < 10, line
    assert proc.returncode == 1 and "DataLoader timed out after 3.0 seconds" in line
    assert (tmp_path / "run" / "checkpoints" / "last.pt").exists()
