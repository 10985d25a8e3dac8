"""DDP on CPU (gloo): torchrun runs, one run directory, rank-0-only files, exact validation, sweeps, submitit."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import psutil
import pytest
import torch
from helpers import FAST, _wait_for, run_torchrun, run_train, start_torchrun
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from imgtrain.common.errors import ConfigError
from imgtrain.host import dist

# The whole file is slow: the fast suite's budget (make test <= 120 s on 2 cores); CI runs it in make test-slow
pytestmark = pytest.mark.slow

# 256 training images over 2 ranks of 32 = 4 steps per epoch; 65 validation images (odd: DistributedSampler
# would pad one duplicate).
DDP = list(FAST)  # its dataset.num_val, data.num_workers and train.epochs are overridden where it is used
DDP += ["dataset.num_val=65", "data.num_workers=0"]


@pytest.fixture(scope="module")
def ddp_run(tmp_path_factory: pytest.TempPathFactory, data_dir: Path) -> tuple[Path, object]:
    cwd = tmp_path_factory.mktemp("ddp")
    result = run_torchrun(
        [*DDP, "train.epochs=2"], cwd, data_dir
    )  # no hydra.run.dir: the ranks must agree on outputs/<date>/<time>
    assert result.returncode == 0, result.stderr[-4000:]
    return cwd, result


def _run_dirs(cwd: Path) -> list[Path]:
    return [p for p in (cwd / "outputs").glob("*/*") if p.is_dir()]


def test_one_run_directory_for_all_ranks(ddp_run) -> None:
    cwd, _ = ddp_run
    runs = _run_dirs(cwd)
    assert len(runs) == 1, runs
    assert (runs[0] / ".hydra" / "config.yaml").exists()


def test_metrics_are_global(ddp_run) -> None:
    cwd, _ = ddp_run
    metrics = json.loads((_run_dirs(cwd)[0] / "metrics.json").read_text())
    assert metrics["world_size"] == 2
    assert metrics["batch_size_global"] == 64
    assert metrics["steps"] == 8  # 2 epochs x (256 / 2 ranks / 32)
    assert metrics["val_count"] == 65  # every validation image counted once, no padding duplicates
    assert metrics["images_per_sec"] > metrics["images_per_sec_per_process"] > 0  # summed over ranks
    assert metrics["data_wait_frac_max"] >= metrics["data_wait_frac"] >= 0
    assert len(metrics["gpu_util_mean_per_rank"]) == 2


def test_tensorboard_from_rank_zero_only(ddp_run) -> None:
    cwd, _ = ddp_run
    tb = _run_dirs(cwd)[0] / "tb"
    assert len(list(tb.glob("events.out.tfevents.*"))) == 1
    events = EventAccumulator(str(tb))
    events.Reload()
    assert {"perf/images_per_sec", "perf/data_wait_frac", "perf/data_wait_frac_max"} <= set(events.Tags()["scalars"])


def test_other_ranks_print_warnings_only(ddp_run) -> None:
    _, result = ddp_run
    assert result.stdout.count("DataLoader (train):") == 1  # an INFO line: rank 0 alone prints it
    assert result.stdout.count("Run summary") == 1
    assert result.stdout.count("pre-flight: /dev/shm") == 1  # the pre-flight summary, rank 0's alone


@pytest.mark.slow  # several torchrun or submitit processes
def test_sweep_inside_torchrun(tmp_path: Path, data_dir: Path) -> None:
    args = ["-m", "data.num_workers=0,1", *[o for o in DDP if not o.startswith("data.num_workers")]]
    result = run_torchrun([*args, "train.epochs=1"], tmp_path, data_dir)
    assert result.returncode == 0, result.stderr[-4000:]
    sweeps = [p for p in (tmp_path / "outputs" / "multirun").glob("*/*") if p.is_dir()]
    assert len(sweeps) == 1, sweeps
    for job, workers in ((0, 0), (1, 1)):
        metrics = json.loads((sweeps[0] / str(job) / "metrics.json").read_text())
        assert metrics["world_size"] == 2 and metrics["loader"]["num_workers"] == workers
        assert metrics["val_count"] == 65


@pytest.mark.slow  # several torchrun or submitit processes
def test_submitit_local_with_two_tasks(tmp_path: Path, data_dir: Path) -> None:
    sweep = tmp_path / "sweep"
    args = ["-m", "hydra/launcher=submitit_local", "hydra.launcher.tasks_per_node=2", f"hydra.sweep.dir={sweep}"]
    result = run_train([*args, *DDP, "train.epochs=1"], tmp_path / "unused", data_dir, timeout=400)
    assert result.returncode == 0, result.stderr[-4000:]
    metrics = json.loads((sweep / "0" / "metrics.json").read_text())
    assert metrics["world_size"] == 2 and metrics["val_count"] == 65
    assert len(list((sweep / "0" / "tb").glob("events.out.tfevents.*"))) == 1
    assert (sweep / "sweep_summary.csv").exists()  # the report callback also ends submitit sweeps


def test_more_processes_than_gpus_fails_clearly(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)  # every process sees the same, only GPU
    info = dist.DistInfo(rank=1, local_rank=1, world_size=2, local_world_size=2)
    with pytest.raises(ConfigError, match="2 processes on this node but only 1 GPU"):
        dist.resolve_device("cuda", info)
    with pytest.raises(ConfigError, match="2 processes on this node"):
        dist.resolve_device("auto", dist.DistInfo(rank=0, local_rank=0, world_size=2, local_world_size=2))


def test_a_task_that_sees_only_its_own_gpu_uses_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """SLURM --gpus-per-task=1: task 1 of 2 on a node sees one GPU, as device 0."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3")
    info = dist.DistInfo(rank=1, local_rank=1, world_size=2, local_world_size=2)
    assert dist.resolve_device("auto", info) == torch.device("cuda", 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)  # two visible: LOCAL_RANK picks, as before
    assert dist.resolve_device("auto", info) == torch.device("cuda", 1)


def test_nccl_binds_the_process_group_to_the_device(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = {}
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: None)
    monkeypatch.setattr(dist, "_rendezvous_store", lambda timeout_s: torch.distributed.HashStore())
    monkeypatch.setattr(torch.distributed, "init_process_group", lambda **kw: calls.update(kw))
    monkeypatch.setattr(torch.distributed, "new_group", lambda **kw: None)
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: False)
    dist.setup(dist.DistInfo(world_size=2, local_world_size=2), torch.device("cuda", 1))
    assert calls["backend"] == "nccl" and calls["device_id"] == torch.device("cuda", 1)
    calls.clear()
    dist.setup(dist.DistInfo(world_size=2, local_world_size=2), torch.device("cpu"))
    assert calls["backend"] == "gloo" and "device_id" not in calls


def test_a_collective_failed_by_a_gone_peer_is_one_line_naming_it() -> None:
    gloo = RuntimeError("[/pytorch/gloo/transport/tcp/pair.cc:561] Connection closed by peer [127.0.0.1]:924. This is")
    line = str(dist.lost_peer(gloo, dist.DistInfo(rank=1, world_size=2)))
    assert line.startswith("rank 1 stopped: another rank ended during a collective (Connection closed by peer")
    assert dist.lost_peer(gloo, dist.DistInfo(rank=0, world_size=1)) is None  # no peers: not this
    assert dist.lost_peer(RuntimeError("shape mismatch"), dist.DistInfo(rank=1, world_size=2)) is None


def test_a_single_torchrun_process_joins_a_process_group(monkeypatch: pytest.MonkeyPatch) -> None:
    """nanoGPT's rule: under torchrun, even --nproc_per_node=1 runs the DDP path (and its backend)."""
    for key in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE"):
        monkeypatch.setenv(key, "1" if "SIZE" in key else "0")
    assert not dist.dist_info_from_env().enabled
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "abc")
    assert dist.dist_info_from_env().enabled


def test_dist_info_from_torchrun_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for key, value in {"RANK": "3", "LOCAL_RANK": "1", "WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2"}.items():
        monkeypatch.setenv(key, value)
    assert dist.dist_info_from_env() == dist.DistInfo(rank=3, local_rank=1, world_size=4, local_world_size=2)


def test_launch_time_is_shared_by_torchrun_workers(monkeypatch: pytest.MonkeyPatch) -> None:
    import os

    import psutil

    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "test")
    dist.launch_time.cache_clear()
    try:
        # Every worker of one torchrun agent has that agent as its parent: the same time in each of them.
        assert dist.launch_time().timestamp() == int(psutil.Process(os.getppid()).create_time())
    finally:
        dist.launch_time.cache_clear()


def test_only_rank_zero_writes_hydra_files(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RANK", "0")
    assert dist._rank_zero_only(".hydra") == ".hydra"
    monkeypatch.setenv("RANK", "1")
    assert dist._rank_zero_only(".hydra") is None
    assert dist._rank_zero_only("run/train.log", "/dev/null") == "/dev/null"


@pytest.mark.slow  # several torchrun or submitit processes
def test_preemption_stops_every_rank_and_a_torchrun_restart_resumes(tmp_path: Path, data_dir: Path) -> None:
    """SIGTERM to one of two ranks: both save-and-stop at the same step; torchrun restarts them; they resume."""
    import signal
    import time

    import psutil

    args = [*DDP, "train.epochs=3", "checkpoint.every_n_steps=2", "data.num_workers=1"]
    proc = start_torchrun(args, tmp_path, data_dir, launcher=["--max-restarts=1"])
    deadline = time.monotonic() + 180
    while not list(tmp_path.glob("outputs/*/*/checkpoints/last.pt")):
        assert proc.poll() is None and time.monotonic() < deadline, "no checkpoint before the run ended"
        time.sleep(0.05)
    ranks = [p for p in psutil.Process(proc.pid).children() if "train.py" in " ".join(p.cmdline())]
    rank_one = next(p for p in ranks if p.environ().get("RANK") == "1")
    rank_one.send_signal(signal.SIGTERM)  # one rank only: the other learns of it at the next step boundary
    output, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, output[-4000:]
    stops = [
        line.split("stopped at step ")[1].split(".")[0] for line in output.splitlines() if "stopped at step" in line
    ]
    assert len(stops) == 2 and stops[0] == stops[1], output[-4000:]  # both ranks, at the same step
    assert "resuming from" in output and f": step {stops[0]}," in output
    runs = _run_dirs(tmp_path)
    assert len(runs) == 1  # the restarted workers found the same run directory
    metrics = json.loads((runs[0] / "metrics.json").read_text())
    assert metrics["steps"] == 12 and metrics["world_size"] == 2


@pytest.mark.slow  # several torchrun or submitit processes
def test_a_nan_on_one_rank_is_skipped_on_every_rank(tmp_path: Path, data_dir: Path) -> None:
    args = [*DDP, "train.epochs=1", "model._target_=faults.build_nan_model", "faults.nonfinite=skip"]
    import os

    os.environ["PYTHONPATH"] = str(Path(__file__).parent)
    os.environ["IMGTRAIN_FAULT_NAN_CALLS"], os.environ["IMGTRAIN_FAULT_RANK"] = "2", "1"
    try:
        result = run_torchrun(args, tmp_path, data_dir)
    finally:
        for key in ("PYTHONPATH", "IMGTRAIN_FAULT_NAN_CALLS", "IMGTRAIN_FAULT_RANK"):
            os.environ.pop(key, None)
    assert result.returncode == 0, result.stderr[-4000:]
    metrics = json.loads((_run_dirs(tmp_path)[0] / "metrics.json").read_text())
    assert metrics["nonfinite_steps"] == 1  # rank 0's loss was finite: it skipped because rank 1 said so
    assert metrics["steps"] == 4


@pytest.mark.slow  # three torchrun jobs
def test_sigterm_to_torchrun_then_resume_matches_an_uninterrupted_two_process_run(tmp_path: Path, data_dir: Path):
    """SIGTERM to the torchrun agent (what SLURM and Ctrl-C send): it stops both ranks, which save and exit; the
    same command then resumes, and the weights and final loss equal those of one uninterrupted 2-process run."""
    args = [*DDP, "train.epochs=3", "checkpoint.every_n_steps=2", "data.num_workers=1"]
    args += ["system.deterministic=true"]
    straight = tmp_path / "straight"
    assert run_torchrun([*args, f"hydra.run.dir={straight}"], tmp_path, data_dir).returncode == 0
    run_dir = tmp_path / "interrupted"
    proc = start_torchrun([*args, f"hydra.run.dir={run_dir}"], tmp_path, data_dir)
    _wait_for(run_dir / "checkpoints" / "last.pt", proc, timeout=180)
    proc.send_signal(signal.SIGTERM)  # to the agent, which passes it on to its workers
    output, _ = proc.communicate(timeout=300)
    assert proc.returncode != 0 and output.count("stopped at step") == 2, output[-4000:]
    stopped = torch.load(run_dir / "checkpoints" / "last.pt", weights_only=True)["progress"]["step"]
    assert stopped < 12 and not (run_dir / "metrics.json").exists()

    resumed = run_torchrun([*args, f"hydra.run.dir={run_dir}"], tmp_path, data_dir)
    assert resumed.returncode == 0, resumed.stderr[-4000:]
    assert f": step {stopped}," in resumed.stdout + resumed.stderr
    first, second = (json.loads((d / "metrics.json").read_text()) for d in (straight, run_dir))
    assert first["steps"] == second["steps"] == 12 and first["val_loss"] == second["val_loss"]
    a, b = (torch.load(d / "checkpoints" / "last.pt", weights_only=True)["model"] for d in (straight, run_dir))
    assert all(torch.equal(a[key], b[key]) for key in a)


@pytest.mark.slow  # two torchrun jobs
@pytest.mark.parametrize("engine", ["dataloader", "threads"])
def test_ctrl_c_under_torchrun_stops_every_rank_at_the_same_step_and_the_same_command_resumes(
    tmp_path: Path, data_dir: Path, engine: str
) -> None:
    """Ctrl-C reaches the agent, both ranks and their workers (or loader threads); the agent forwards it to the ranks
    again at once, which must not count as a second Ctrl-C. Both ranks save the same step; the same command
    continues from it."""
    args = [*DDP, "train.epochs=3", "checkpoint.every_n_steps=2", "data.num_workers=1", f"data.engine={engine}"]
    run_dir = tmp_path / "run"
    proc = start_torchrun([*args, f"hydra.run.dir={run_dir}"], tmp_path, data_dir, session=True)
    _wait_for(run_dir / "checkpoints" / "last.pt", proc, timeout=180)
    os.killpg(proc.pid, signal.SIGINT)
    output, _ = proc.communicate(timeout=300)
    stops = [line for line in output.splitlines() if line.startswith("stopped: SIGINT at step")]
    assert proc.returncode != 0 and len(stops) == 2 and stops[0] == stops[1], output[-4000:]
    assert "KeyboardInterrupt" not in output and "second Ctrl-C" not in output
    stopped = torch.load(run_dir / "checkpoints" / "last.pt", weights_only=True)["progress"]["step"]
    assert f"at step {stopped}:" in stops[0] and not (run_dir / "metrics.json").exists()
    resumed = run_torchrun([*args, f"hydra.run.dir={run_dir}"], tmp_path, data_dir)
    assert resumed.returncode == 0 and f": step {stopped}," in resumed.stdout + resumed.stderr, resumed.stderr[-4000:]
    assert json.loads((run_dir / "metrics.json").read_text())["steps"] == 12


def _loader_workers_of_rank(agent: psutil.Process, rank: str) -> list[psutil.Process]:
    """The DataLoader workers of one rank: under torchrun they are forked by that rank's forkserver."""
    ranks = [child for child in agent.children() if child.environ().get("RANK") == rank]
    servers = [child for child in ranks[0].children() if "forkserver" in " ".join(child.cmdline())]
    return servers[0].children() if servers else []


@pytest.mark.slow  # two torchrun jobs
def test_a_dead_worker_on_one_rank_ends_every_rank_within_seconds_and_the_same_command_resumes(
    tmp_path: Path, data_dir: Path
) -> None:
    """SIGKILL to rank 1's worker (as the OOM killer sends): rank 1 ends with one line naming the worker, the
    other rank does not wait for it in a collective until faults.dist_timeout_s, torchrun exits non-zero within
    seconds, and the same command continues from the last checkpoint."""
    args = [*DDP, "train.epochs=3", "checkpoint.every_n_steps=2", "data.num_workers=1"]
    run_dir = tmp_path / "run"
    proc = start_torchrun([*args, f"hydra.run.dir={run_dir}"], tmp_path, data_dir, session=True)
    _wait_for(run_dir / "checkpoints" / "last.pt", proc, timeout=180)
    victim = _loader_workers_of_rank(psutil.Process(proc.pid), "1")[0]
    started = time.monotonic()
    victim.kill()
    output, _ = proc.communicate(timeout=300)
    elapsed = time.monotonic() - started
    assert proc.returncode != 0 and elapsed < 45, (elapsed, output[-4000:])
    ends = [line for line in output.splitlines() if line.startswith(("error: ", "stopped: "))]
    workers = [line for line in ends if line.startswith("error: DataLoader worker")]
    # rank 0 finds its peer gone in a collective, or gets torchrun's SIGTERM first: either way one line
    rank_0 = ("error: rank 0 stopped: another rank ended during a collective", "stopped: SIGTERM")
    assert len(ends) == 2 and len(workers) == 1 and any(line.startswith(rank_0) for line in ends), output[-4000:]
    worker = workers[0]
    assert f"(pid(s) {victim.pid})" in worker and "Killed" in worker and "Run the same command again" in worker
    # torchrun's agent prints its own summary (ChildFailedError); the ranks print no traceback
    assert "[rank0]: Traceback" not in output and "[rank1]: Traceback" not in output, output[-4000:]
    assert "Error executing job" not in output
    saved = torch.load(run_dir / "checkpoints" / "last.pt", weights_only=True)["progress"]["step"]
    resumed = run_torchrun([*args, f"hydra.run.dir={run_dir}"], tmp_path, data_dir)
    assert resumed.returncode == 0 and f": step {saved}," in resumed.stdout + resumed.stderr, resumed.stderr[-4000:]
    assert json.loads((run_dir / "metrics.json").read_text())["steps"] == 12
