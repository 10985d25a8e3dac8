"""hydra/launcher=slurm: Hydra's own submitit launcher (hydra-submitit-launcher), which submits a sweep as a Slurm job
array and waits for it, with what a run of this template needs around it and nothing else changed:

- before anything is submitted, a time limit Slurm's signal would reach at once and a job of no task end in one line;
- sbatch's refusal (a partition that does not exist, GPUs its nodes do not have) ends in one line naming the key;
- in the job, rank 0 takes its run directory's lock before Hydra writes there, so another job pointed at the same
  directory leaves it as it was and is refused in one line (the requeued attempt of the same job takes it over); the
  other ranks go on once rank 0 holds it, and stop with it when it is refused (not waiting for it at the rendezvous);
- a job that ended without a result (killed at its time limit, cancelled, out of memory) ends the sweep in one line
  naming the job, how Slurm says it ended, and the command that continues it from its last checkpoint.

A stop signal in a job (Slurm's SIGTERM: a requeue, a preemption, scancel, the time limit) saves a checkpoint and
ends the process without a result, so that the launcher asks Slurm how the job ended: requeued, it waits for the next
attempt, which resumes from that checkpoint. submitit's own signal (SIGUSR2, `signal_delay_s` before the time limit)
saves, then submitit requeues the job (`resilience.faults.StopSignals.hand_over`).
"""

from __future__ import annotations

import re
import socket
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from hydra.core.singleton import Singleton
from hydra.core.utils import JobReturn, JobStatus
from hydra_plugins.hydra_submitit_launcher import submitit_launcher
from omegaconf import DictConfig, open_dict
from submitit.core.utils import FailedJobError, UncompletedJobError

from imgtrain.common.errors import EXIT_BAD_INPUT, EXIT_FAILED, ConfigError, RunEnded, RunError
from imgtrain.host import dist
from imgtrain.resilience import rundir
from imgtrain.resilience.lockfile import look, well_formed, who

SINFO_TIMEOUT_S = 10.0  # the one sinfo call that lists what the cluster has, for a refused submission's line
RANK_ZERO_LOCK_S = 60.0  # how long the other ranks of a job wait for its rank 0 to hold the run directory's lock
LOCK_POLL_S = 0.2

# How Slurm names a job's end (sacct's State), as the line says it
ENDED = {
    "TIMEOUT": "was killed at its time limit (hydra.launcher.timeout_min)",
    "CANCELLED": "was cancelled (scancel)",
    "OUT_OF_MEMORY": "ran out of memory (hydra.launcher.mem_gb)",
    "NODE_FAIL": "lost its node",
    "PREEMPTED": "was preempted and not requeued",
    "FAILED": "failed",
}

# sbatch's refusals: what its message says, the key it names, and what to do
REFUSALS = (
    ("invalid partition", "partition", "%R", "the partitions here are"),
    ("generic resource", "gpus_per_node", "%R %G", "the GPUs (gres) of the partitions here are"),
    ("invalid account", "account", None, "ask your cluster's administrators which accounts you may use"),
    ("time limit", "timeout_min", "%R %l", "the partitions' time limits are"),
    ("node configuration is not available", "cpus_per_task", "%R %c %m", "the partitions' CPUs and memory are"),
)


def _sinfo(fields: str) -> str:
    """What the cluster has, in one line (`sinfo -h -o FIELDS`); '?' where sinfo does not answer."""
    try:
        done = subprocess.run(["sinfo", "-h", "-o", fields], capture_output=True, text=True, timeout=SINFO_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired):
        return "?"
    return "; ".join(sorted({line.strip() for line in done.stdout.splitlines() if line.strip()})) or "?"


def refusal_line(message: str, params: dict[str, Any]) -> str:
    """One line for sbatch's refusal `message` (its last line), naming the key that caused it."""
    said = message.strip().splitlines()[-1] if message.strip() else "no message"
    for sign, key, fields, what in REFUSALS:
        if sign in message.lower():
            found = f"{what}: {_sinfo(fields)}" if fields else what
            return f"Slurm refused the job ({said}): hydra.launcher.{key}={params.get(key)}; {found}"
    return f"Slurm refused the job ({said}); check hydra.launcher's keys against `sinfo` for this cluster"


def check_limits(params: dict[str, Any]) -> None:
    """Before anything is submitted: a signal due as the job starts, or no task, is a ConfigError."""
    limit_s, delay_s = 60 * int(params.get("timeout_min") or 0), int(params.get("signal_delay_s") or 0)
    if delay_s >= limit_s:
        raise ConfigError(
            f"hydra.launcher.signal_delay_s={delay_s} is not below the time limit, hydra.launcher.timeout_min="
            f"{params.get('timeout_min')} ({limit_s} s): Slurm would signal the job to save and requeue as it "
            "starts, before its first checkpoint, every time. Raise timeout_min or lower signal_delay_s (Slurm may "
            "send the signal up to 60 s before the time asked)"
        )
    if int(params.get("tasks_per_node") or 0) < 1:
        raise ConfigError(
            f"hydra.launcher.tasks_per_node={params.get('tasks_per_node')}: a job needs at least one task (one per "
            "GPU; tasks_per_node follows gpus_per_node, so a CPU job sets tasks_per_node=1 or more itself)"
        )


def rank_zero_locked(directory: Path) -> str | None:
    """On a job's other ranks: None once its rank 0 holds `directory`'s lock, or why it will not: the lock is another
    live run's (rank 0 is refused it too), or rank 0 has not taken it within RANK_ZERO_LOCK_S (its log says why)."""
    job, host = rundir.job_id(), socket.gethostname()
    deadline = time.monotonic() + RANK_ZERO_LOCK_S
    while time.monotonic() < deadline:
        holder = look(directory / rundir.LOCK_NAME).holder
        if job and holder.get("job") == job:
            return None  # this job's: rank 0's, or an earlier attempt's that rank 0 takes over
        if well_formed(holder) and rundir.stale_reason(holder, time.time(), host, job) is None:
            pid, where = who(holder)
            return f"the run directory {directory} is in use by pid {pid} on {where} (job {holder.get('job') or '?'})"
        time.sleep(LOCK_POLL_S)
    return f"rank 0 did not take the lock of {directory} within {RANK_ZERO_LOCK_S:.0f} s: its line says why"


def ended_line(error: UncompletedJobError, sweep: Path, first_job: int) -> str:
    """One line for a job that ended without a result (or whose process failed outside the training run)."""
    text = str(error)
    job = re.search(r"Job (\S+) \(task", text)
    state = re.search(r"\(state: ([A-Z_]+)", text)
    name = job.group(1) if job else "?"
    index = name.rsplit("_", 1)[-1] if "_" in name else "0"
    directory = sweep / str(first_job + int(index)) if index.isdigit() else sweep
    log = sweep / ".submitit" / name / f"{name}_0_log.err"
    if state is None:  # the job's process failed before or after the training run: its traceback's last line
        lines = [line for line in text.splitlines() if line.strip() and not line.startswith(("-", " "))]
        return f"Slurm job {name} failed: {lines[-1] if lines else 'no message'} (its log: {log})"
    how = ENDED.get(state.group(1).split()[0], f"ended with state {state.group(1)}")
    return (
        f"Slurm job {name} {how} before it finished: {directory} keeps its last checkpoint; run the same command "
        f"again with hydra.sweep.dir={sweep} to continue from it (the job's log: {log})"
    )


class SlurmLauncher(submitit_launcher.SlurmLauncher):
    """hydra-submitit-launcher's SlurmLauncher, with the checks and one-line ends above."""

    def launch(self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int) -> Sequence[JobReturn]:
        try:
            check_limits(self.params)
        except ConfigError as error:
            raise RunEnded(EXIT_BAD_INPUT, f"error: {error}") from error
        try:
            results = super().launch(job_overrides, initial_job_idx)
        except FailedJobError as error:
            if str(error).lstrip().startswith("sbatch"):  # refused at submission: bad input
                raise RunEnded(EXIT_BAD_INPUT, f"error: {refusal_line(str(error), self.params)}") from error
            raise RunEnded(EXIT_FAILED, f"error: {ended_line(error, self._sweep(), initial_job_idx)}") from error
        except UncompletedJobError as error:
            raise RunEnded(EXIT_FAILED, f"error: {ended_line(error, self._sweep(), initial_job_idx)}") from error
        for result in results:  # a job refused its run directory (`__call__`): its line, as a single run's
            if result.status == JobStatus.FAILED and isinstance(result._return_value, RunError):
                raise RunEnded(EXIT_FAILED, f"error: {result._return_value}")
        return results

    def _sweep(self) -> Path:
        assert self.config is not None
        return Path(str(self.config.hydra.sweep.dir))

    def __call__(
        self,
        sweep_overrides: list[str],
        job_dir_key: str,
        job_num: int,
        job_id: str,
        singleton_state: dict[type, Singleton],
    ) -> JobReturn:
        """In the job: rank 0 locks the job's directory before Hydra writes there, the other ranks wait for it to hold
        it, then Hydra runs the job. A refusal is the job's error, which the launcher ends the sweep with."""
        lock = None
        config = self._job_config(sweep_overrides, job_num, singleton_state)
        directory = Path(str(config.hydra.sweep.dir)) / str(config.hydra.sweep.subdir)
        if dist.global_rank() == 0:
            try:
                lock = rundir.lock_before_hydra(config, directory)
            except RunEnded as refused:
                return JobReturn(status=JobStatus.FAILED, _return_value=RunError(refused.line.removeprefix("error: ")))
        elif (refusal := rank_zero_locked(directory.resolve())) is not None:
            return JobReturn(status=JobStatus.FAILED, _return_value=RunError(refusal))
        try:
            return super().__call__(sweep_overrides, job_dir_key, job_num, job_id, singleton_state)
        finally:
            if lock is not None:
                lock.__exit__()

    def _job_config(self, overrides: list[str], job_num: int, singleton_state: dict[type, Singleton]) -> DictConfig:
        """The job's config as Hydra's `run_job` will see it (its directory is the sweep's, then the job's)."""
        assert self.hydra_context is not None and self.config is not None
        Singleton.set_state(singleton_state)
        config = self.hydra_context.config_loader.load_sweep_config(self.config, list(overrides))
        with open_dict(config.hydra.job):
            config.hydra.job.num = job_num
        return config
