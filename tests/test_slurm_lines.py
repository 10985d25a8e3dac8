"""The Slurm job a process belongs to, and the launcher's one-line ends, without a cluster (tests/test_slurm.py runs
them against a real one): Slurm's variables as it sets them, submitit's messages as it writes them."""

from __future__ import annotations

from pathlib import Path

import pytest
from submitit.core.utils import UncompletedJobError

from hydra_plugins.imgtrain_slurm.slurm_launcher import check_limits, ended_line
from imgtrain.common.errors import ConfigError
from imgtrain.host.slurm import current_job

ARRAY_TASK = {"SLURM_JOB_ID": "13", "SLURM_ARRAY_JOB_ID": "12", "SLURM_ARRAY_TASK_ID": "1", "SLURM_RESTART_COUNT": "2",
              "SLURM_JOB_PARTITION": "gpu", "SLURM_JOB_NODELIST": "node[1-2]", "SLURM_NTASKS": "16"}  # fmt: skip


def test_the_job_array_index_and_attempt_come_from_slurms_variables() -> None:
    assert current_job({}) is None and current_job({"SLURM_JOB_ID": ""}) is None  # not in a Slurm job
    job = current_job(ARRAY_TASK)
    assert (job.name, job.attempt, job.array_index, job.tasks) == ("12_1", 3, 1, 16)
    assert job.describe() == (
        "Slurm job 12_1 (job id 13), attempt 3 (requeued 2 times), partition gpu, 16 task(s) on node[1-2]"
    )
    assert job.fields()["name"] == "12_1" and job.fields()["restart_count"] == 2
    first = current_job({"SLURM_JOB_ID": "7"})  # sbatch without an array, first attempt (no SLURM_RESTART_COUNT)
    assert (first.name, first.attempt, first.describe()) == ("7", 1, "Slurm job 7, attempt 1")


def test_a_job_of_no_task_is_refused_before_submitting() -> None:
    with pytest.raises(ConfigError, match="tasks_per_node=0: a job needs at least one task"):
        check_limits({"timeout_min": 60, "signal_delay_s": 120, "tasks_per_node": 0})
    check_limits({"timeout_min": 3, "signal_delay_s": 120, "tasks_per_node": 1})  # signalled 60 s in: allowed


def test_a_job_killed_at_its_time_limit_is_named_with_the_command_that_continues_it(tmp_path: Path) -> None:
    """submitit's message for a job of an array that ended without a result (Job.result, submitit 1.5)."""
    message = (
        f"Job 8_2 (task: 0) with path {tmp_path}/.submitit/8_2/8_2_0_result.pkl\n"
        "has not produced any output (state: TIMEOUT)\nError stream produced:\n----------------------------------------"
    )
    line = ended_line(UncompletedJobError(message), tmp_path, first_job=0)
    assert line.startswith(f"Slurm job 8_2 was killed at its time limit (hydra.launcher.timeout_min) before it "
                           f"finished: {tmp_path}/2 keeps its last checkpoint; run the same command again with "
                           f"hydra.sweep.dir={tmp_path} to continue")  # fmt: skip
    cancelled = ended_line(UncompletedJobError(message.replace("TIMEOUT", "CANCELLED by 0")), tmp_path, 0)
    assert "Slurm job 8_2 was cancelled (scancel)" in cancelled
