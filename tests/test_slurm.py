"""hydra/launcher=slurm against a real single-node Slurm cluster with accounting (tests/slurm_cluster.py, started once
for this module): sweeps as job arrays, DDP inside a job, preemption and requeue, time limits, and bad input. Nothing
is mocked: each case runs `python train.py -m ...` as a user would and drives its jobs with Slurm's own commands.

Time: a time limit is a minute at least, and Slurm's signal before it comes anywhere in the last minute before the
time asked (its clock checks every 30 s). So what takes long by nature is started first (`runs`, which the first
test asks for): the two time-limit cases and three jobs stopped by hand, checked last, while the sweeps, DDP and bad
input run. The hand stops come as soon as a job's first checkpoint is on disk, with the commands that deliver what
Slurm delivers (`scontrol requeue`, `scancel --signal=USR2` for the time-limit signal, `scancel`).
"""

from __future__ import annotations

import csv
import json
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import slurm_cluster
from helpers import ROOT
from slurm_fixture import (
    ON_THIS_CLUSTER,
    STATES,
    TESTS,
    TINY,
    Launch,
    error_lines,
    job_state,
    launch,
    metrics,
    started_cluster,
    wait_for,
    wait_for_state,
)

pytestmark = pytest.mark.slow

# The Slurm commands the tests issue, as docs/clusters.md writes them (test_every_slurm_command_in_the_docs_...)
REQUEUE = ("scontrol", "requeue")
TIME_LIMIT_SIGNAL = ("scancel", "--signal=USR2")  # what --signal=USR2@<signal_delay_s> delivers, now
CANCEL = ("scancel",)
LAUNCHER_KEYS = {"partition", "gpus_per_node", "tasks_per_node", "cpus_per_task", "timeout_min", "signal_delay_s"}
TIMEOUT_S = 300  # for any one case: bounded, far above what it takes (about 2 minutes for the longest)


def on_cluster(**keys: object) -> list[str]:
    """ON_THIS_CLUSTER with some hydra.launcher keys set otherwise."""
    given = {f"hydra.launcher.{key}" for key in keys}
    kept = [arg for arg in ON_THIS_CLUSTER if arg.split("=", 1)[0] not in given]
    return [*kept, *(f"hydra.launcher.{key}={value}" for key, value in keys.items())]


@dataclass
class Runs:
    cluster: slurm_cluster.Cluster
    data_dir: Path
    root: Path
    launches: dict[str, Launch] = field(default_factory=dict)
    reference: subprocess.Popen | None = None
    jobs: dict[str, str] = field(default_factory=dict)  # the stopped jobs' ids
    hydra_files: dict[Path, bytes] = field(default_factory=dict)  # the stalled job's, before the second launch
    second: tuple[str, int, str] = ("", 0, "")  # the second launch into its directory: job, exit status, output

    def start(self, name: str, args: list[str], sweep: str | None = None, **env: str) -> Launch:
        self.launches[name] = launch(self.cluster, args, self.root / (sweep or name), self.data_dir, **env)
        return self.launches[name]

    def reference_loss(self) -> float:
        """The uninterrupted run's val_loss, outside Slurm: what every resumed job must reach, bit for bit."""
        assert self.reference is not None
        assert self.reference.wait(TIMEOUT_S) == 0, (self.root / "reference.txt").read_text()[-3000:]
        return metrics(self.root / "reference")["val_loss"]


PREEMPTED = [*ON_THIS_CLUSTER, *TINY]


def _stop_once_saved(runs: Runs, stops: dict[str, tuple[str, ...]], jobs: dict[str, str]) -> None:
    """Send each job its stop command as soon as its first checkpoint is on disk, whichever comes first."""
    deadline = time.monotonic() + TIMEOUT_S
    while stops:
        for name in [name for name in stops if (runs.launches[name].sweep / "0/checkpoints/last.pt").exists()]:
            runs.cluster.command(*stops.pop(name), jobs[name])
        for name in stops:
            assert runs.launches[name].proc.poll() is None, runs.launches[name].out.read_text()[-3000:]
        assert time.monotonic() < deadline, f"no checkpoint from {sorted(stops)}"
        time.sleep(0.1)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[slurm_cluster.Cluster]:
    with started_cluster(tmp_path_factory) as running:
        yield running


@pytest.fixture(scope="module")
def runs(cluster: slurm_cluster.Cluster, data_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Runs]:
    """What takes long by nature, started (and stopped) first: the tests after check it once it has ended.

    The time limits: `signalled`, a 2-minute limit with signal_delay_s=60, so Slurm sends SIGUSR2 30 to 60 s after
    the job starts, slow in its first attempt so that the signal finds it training; `killed`, a 1-minute limit and no
    signal it could act on, its fifth step stalled. The uninterrupted run, outside Slurm. Three jobs stopped once
    their step-2 checkpoint is on disk: the time-limit signal by hand, `scancel`, and, while a third one's fifth step
    stalls, a second launch into its directory (a job of two tasks: neither may wait for the other), then `scontrol
    requeue` of that third job (it cannot save: killed after KillWait)."""
    runs = Runs(cluster, data_dir, tmp_path_factory.mktemp("runs"))
    runs.start("signalled", [*on_cluster(timeout_min=2, signal_delay_s=60), *TINY], IMGTRAIN_TEST_STEP_S="10")
    runs.start("killed", [*on_cluster(timeout_min=1, signal_delay_s=0), *TINY], IMGTRAIN_TEST_STALL_AT_STEP="5")
    cmd = [sys.executable, str(ROOT / "train.py"), *TINY, f"hydra.run.dir={runs.root / 'reference'}"]
    env = cluster.env(PYTHONPATH=str(TESTS), OMP_NUM_THREADS="1", IMGTRAIN_DATA_DIR=str(data_dir))
    with open(runs.root / "reference.txt", "w") as out:
        runs.reference = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT)
    try:
        _preempt(runs)
        yield runs
    finally:
        for started in runs.launches.values():
            if started.proc.poll() is None:
                started.proc.kill()
        if runs.reference.poll() is None:
            runs.reference.kill()


def _preempt(runs: Runs) -> None:
    runs.start("requeue", PREEMPTED, IMGTRAIN_TEST_STALL_AT_STEP="5")
    runs.start("usr2", PREEMPTED, IMGTRAIN_TEST_STEP_S="3")
    runs.start("scancel", PREEMPTED, IMGTRAIN_TEST_STEP_S="3")
    runs.jobs = {name: runs.launches[name].job_ids()[0] for name in ("usr2", "scancel", "requeue")}
    _stop_once_saved(runs, {"usr2": TIME_LIMIT_SIGNAL, "scancel": CANCEL}, runs.jobs)
    stalled = runs.launches["requeue"]
    wait_for(stalled.sweep / "0" / "checkpoints" / "last.pt", stalled, TIMEOUT_S)
    runs.hydra_files = {p: p.read_bytes() for p in (stalled.sweep / "0" / ".hydra").iterdir()}
    second = runs.start("second", [*on_cluster(tasks_per_node=2), *TINY], sweep="requeue")  # both ranks refused
    runs.second = (second.job_ids()[0], *second.finish(TIMEOUT_S))
    runs.cluster.command(*REQUEUE, runs.jobs["requeue"])


def stopped_at(name: str, log: str) -> int:
    """The step a stop signal saved, from the job's line `<SIGNAL>: stopped at step N. The last checkpoint is ...`."""
    found = re.findall(rf"{name}: stopped at step (\d+)\. The last checkpoint is", log)
    assert found, log[-3000:]
    return int(found[-1])


def test_a_sweep_is_a_job_array_and_ends_with_its_report(runs: Runs) -> None:
    """data.num_workers=0,1,-1: three tasks of one array; two train, one fails (its value is refused in the job):
    the report, written once the last job has ended, has all three, the failed one with its reason."""
    run = runs.start("array", [*ON_THIS_CLUSTER, *TINY, "data.num_workers=0,1,-1"])
    array = run.job_ids(3)
    code, out = run.finish(TIMEOUT_S)
    assert code == 0, out[-3000:]
    array_id = array[0].split("_")[0]
    assert array == [f"{array_id}_{index}" for index in range(3)], array  # one array, its tasks in job order
    with open(run.sweep / "sweep_summary.csv") as f:
        rows = {row["job"]: row for row in csv.DictReader(f)}
    assert [rows[job]["status"] for job in ("0", "1", "2")] == ["ok", "ok", "failed"], rows
    assert "data.num_workers=-1 is invalid" in rows["2"]["reason"]
    assert (run.sweep / "sweep_summary.md").exists() and (run.sweep / "sweep_summary.png").exists()
    for index in (0, 1):
        slurm = metrics(run.sweep / str(index))["environment"]["slurm"]
        assert (slurm["array_job_id"], slurm["array_index"], slurm["attempt"]) == (array_id, index, 1), slurm
        log = (run.sweep / str(index) / "train.log").read_text()
        assert f"Slurm job {array_id}_{index} (job id {slurm['job_id']}), attempt 1" in log
    assert job_state(runs.cluster, array[2]) == "COMPLETED"  # a failed run is a job that ended well, with its reason


def test_ddp_inside_a_job_two_tasks(runs: Runs) -> None:
    """tasks_per_node=2: two processes of one job (gloo), their ranks from Slurm's variables through submitit: one
    run directory, validation exact over the ranks (33 images, none padded), one TensorBoard writer."""
    run = runs.start("ddp", [*on_cluster(tasks_per_node=2), *TINY])
    code, out = run.finish(TIMEOUT_S)
    assert code == 0, out[-3000:]
    assert sorted(p.name for p in run.sweep.iterdir() if not p.name.startswith(".")) == [
        "0", "multirun.yaml", "sweep_summary.csv", "sweep_summary.md", "sweep_summary.png",
    ]  # fmt: skip
    summary = metrics(run.sweep / "0")
    assert (summary["world_size"], summary["val_count"], summary["batch_size_global"]) == (2, 33, 32)
    assert summary["environment"]["slurm"]["tasks"] == 2
    assert len(list((run.sweep / "0" / "tb").glob("events.out.tfevents.*"))) == 1
    log = (run.sweep / "0" / "train.log").read_text()
    assert log.count("attempt 1, partition debug, 2 task(s) on localhost") == 1  # rank 0's line, once
    assert "process group: gloo, rank 0 of 2" in log


BAD_INPUT = {
    "partition": on_cluster(partition="nope"),
    "gpus": on_cluster(gpus_per_node=1),
    "too short": on_cluster(timeout_min=1, signal_delay_s=120),
}


@pytest.fixture(scope="module")
def bad_input(runs: Runs) -> dict[str, Launch]:
    return {name: runs.start(name, [*args, *TINY]) for name, args in BAD_INPUT.items()}


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("partition", "hydra.launcher.partition=nope; the partitions here are: debug"),
        ("gpus", "hydra.launcher.gpus_per_node=1; the GPUs (gres) of the partitions here are: debug (null)"),
        ("too short", "hydra.launcher.signal_delay_s=120 is not below the time limit"),
    ],
)
def test_bad_input_ends_in_one_line_before_any_job_runs(bad_input: dict[str, Launch], name: str, expected: str) -> None:
    """A partition that does not exist and GPUs the node does not have (sbatch refuses them), and a time limit that
    Slurm's signal would reach as the job starts (refused before submitting): one line each, no job."""
    run = bad_input[name]
    code, out = run.finish(TIMEOUT_S)
    assert code == 2, out[-3000:]
    assert len(lines := error_lines(out)) == 1 and expected in lines[0], lines
    assert not (run.sweep / ".submitit").exists() or not any(p.is_dir() for p in (run.sweep / ".submitit").iterdir())


def test_scontrol_requeue_resumes_exactly_and_takes_over_its_own_directory(runs: Runs) -> None:
    run, job = runs.launches["requeue"], runs.jobs["requeue"]
    code, out = run.finish(TIMEOUT_S)
    assert code == 0, out[-3000:]
    summary = metrics(run.sweep / "0")
    assert summary["val_loss"] == runs.reference_loss()  # bit for bit: from the step-4 checkpoint, the stall unsaved
    assert (summary["environment"]["slurm"]["job_id"], summary["environment"]["slurm"]["restart_count"]) == (job, 1)
    log = (run.sweep / "0" / "train.log").read_text()
    assert f"Slurm job {job}, attempt 2 (requeued 1 time)" in log and "checkpoints/last.pt: step 4," in log
    # its first attempt was killed holding the lock: the second, with the same SLURM_JOB_ID, takes it over
    assert "(an earlier attempt of this job) is no longer running" in run.job_log(job)


def test_another_job_on_a_running_jobs_directory_is_refused_and_changes_nothing(runs: Runs) -> None:
    job, code, out = runs.second
    assert code == 1, out[-3000:]
    assert len(lines := error_lines(out)) == 1 and "is in use by pid" in lines[0], out[-3000:]
    directory = runs.launches["requeue"].sweep / "0"
    assert not (directory / "failed.json").exists()
    assert all(path.read_bytes() == content for path, content in runs.hydra_files.items())
    assert f"Slurm job {job}," not in (directory / "train.log").read_text()  # not a line of it in the job's log


def test_the_time_limit_signal_saves_requeues_and_resumes_exactly(runs: Runs) -> None:
    """SIGUSR2, as Slurm sends it signal_delay_s before the time limit, here by hand: a checkpoint at the next step,
    then submitit requeues the job, and its next attempt continues from that checkpoint."""
    run, job = runs.launches["usr2"], runs.jobs["usr2"]
    code, out = run.finish(TIMEOUT_S)
    assert code == 0, out[-3000:]
    summary = metrics(run.sweep / "0")
    assert summary["val_loss"] == runs.reference_loss() and summary["environment"]["slurm"]["restart_count"] == 1
    log = run.job_log(job)
    assert "SIGUSR2 received: saving a checkpoint" in log
    assert f"checkpoints/last.pt: step {stopped_at('SIGUSR2', log)}," in (run.sweep / "0" / "train.log").read_text()


def test_scancel_saves_and_ends_in_one_line_and_the_same_command_continues(runs: Runs) -> None:
    run, job = runs.launches["scancel"], runs.jobs["scancel"]
    code, out = run.finish(TIMEOUT_S)
    assert code == 1, out[-3000:]
    assert len(lines := error_lines(out)) == 1, out[-3000:]
    assert f"Slurm job {job} was cancelled (scancel) before it finished" in lines[0]
    assert f"run the same command again with hydra.sweep.dir={run.sweep}" in lines[0]
    assert job_state(runs.cluster, job).startswith("CANCELLED")
    step = stopped_at("SIGTERM", run.job_log(job))  # the job's own line: its checkpoint saved
    assert "the sweep ends here" not in run.job_log(job)  # a job of its own: its launcher says what ends
    code, out = runs.start("again", PREEMPTED, sweep="scancel").finish(TIMEOUT_S)  # the same command: it continues
    assert code == 0, out[-3000:]
    assert metrics(run.sweep / "0")["val_loss"] == runs.reference_loss()
    assert f"checkpoints/last.pt: step {step}," in (run.sweep / "0" / "train.log").read_text()


def test_a_time_limit_signal_from_slurm_requeues_and_resumes_exactly(runs: Runs) -> None:
    """Slurm's own SIGUSR2, 30 to 60 s into the job: a checkpoint at the next step, submitit requeues the job, and the
    next attempt resumes (one that Slurm signals again before it ends does the same once more)."""
    run = runs.launches["signalled"]
    job = run.job_ids()[0]
    code, out = run.finish(TIMEOUT_S)
    assert code == 0, out[-3000:]
    summary = metrics(run.sweep / "0")
    assert summary["val_loss"] == runs.reference_loss() and summary["environment"]["slurm"]["restart_count"] >= 1
    log = run.job_log(job)
    assert "Caught signal SIGUSR2" in log and "this job is timed-out" in log  # Slurm's, at its time: submitit says
    assert f"checkpoints/last.pt: step {stopped_at('SIGUSR2', log)}," in (run.sweep / "0" / "train.log").read_text()


def test_a_job_killed_at_its_time_limit_resumes_from_its_last_checkpoint(runs: Runs) -> None:
    """Its fifth step stalls, so nothing can be acted on: killed at the time limit (TIMEOUT in accounting), it keeps
    its step-4 checkpoint, and the same command continues from it. The launcher says so in one line once submitit
    next asks sacct, which it does less often as the job ages (at up to half its age): if it has not yet, the test
    does not wait for it, and the user's Ctrl-C ends it."""
    run = runs.launches["killed"]
    job = run.job_ids()[0]
    assert wait_for_state(runs.cluster, job, {"TIMEOUT", "COMPLETED", "FAILED", "CANCELLED"}, TIMEOUT_S) == "TIMEOUT"
    if run.proc.poll() is None:
        run.proc.send_signal(signal.SIGINT)
    code, out = run.finish(60)
    if code != 128 + signal.SIGINT:  # it had asked: its line names the job, how it ended, and how to continue
        assert code == 1 and len(lines := error_lines(out)) == 1, out[-3000:]
        assert f"Slurm job {job} was killed at its time limit (hydra.launcher.timeout_min)" in lines[0]
    assert "DUE TO TIME LIMIT" in run.job_log(job)
    code, out = runs.start("rerun", [*on_cluster(timeout_min=1, signal_delay_s=0), *TINY], sweep="killed").finish(
        TIMEOUT_S
    )
    assert code == 0, out[-3000:]
    assert metrics(run.sweep / "0")["val_loss"] == runs.reference_loss()
    assert "checkpoints/last.pt: step 4," in (run.sweep / "0" / "train.log").read_text()  # its last periodic one


def _doc_commands() -> list[str]:
    """The commands of docs/clusters.md's Slurm section, one per entry, continuation lines joined, comments cut."""
    section = (ROOT / "docs" / "clusters.md").read_text().split("\n## Slurm", 1)[1].split("\n## ", 1)[0]
    commands = []
    for block in re.findall(r"```bash\n(.*?)```", section, re.DOTALL):
        lines = block.replace("\\\n", " ").splitlines()
        commands += [" ".join(line.split("#", 1)[0].split()) for line in lines if line.split("#", 1)[0].strip()]
    return commands


def test_every_slurm_command_in_the_docs_is_one_the_tests_ran() -> None:
    """docs/clusters.md's Slurm commands: its train.py commands set only launcher keys these tests set, and every
    other command is one the tests issue (REQUEUE, TIME_LIMIT_SIGNAL, CANCEL, STATES), with a job id."""
    commands = _doc_commands()
    issued = {" ".join(command) for command in (REQUEUE, TIME_LIMIT_SIGNAL, CANCEL, STATES)}
    assert len(commands) >= 5, commands
    for command in commands:
        if command.startswith("python train.py"):
            assert "hydra/launcher=slurm" in command, command
            keys = {word.split("=")[0].removeprefix("hydra.launcher.") for word in command.split()
                    if word.startswith("hydra.launcher.")}  # fmt: skip
            assert keys <= LAUNCHER_KEYS, f"{command}: {keys - LAUNCHER_KEYS} never set by a test"
        else:
            assert command.rsplit(" ", 1)[0] in issued, f"{command}: not a command the tests ran"


def test_the_cluster_runs_from_the_pids_it_kept(cluster: slurm_cluster.Cluster) -> None:
    """Every daemon runs as the process the script started and recorded (what `stop` ends), and the node is up."""
    pids = json.loads((cluster.folder / "pids.json").read_text())
    assert set(pids) == {"munged", "mariadbd", "slurmdbd", "slurmctld", "slurmd"}
    assert all(slurm_cluster._process(*pid) is not None for pid in pids.values())
    assert cluster.command("sinfo", "-h", "-o", "%P %a").split() == ["debug*", "up"]
