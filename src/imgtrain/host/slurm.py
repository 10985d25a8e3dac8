"""Which Slurm job this process belongs to: its id, its array index and its attempt, from Slurm's own variables.

Slurm sets them in every process of a job (sbatch, srun, submitit's tasks). A requeued job keeps its id and runs
again with SLURM_RESTART_COUNT one higher; each task of a job array has an id of its own, and the array's id and
its index beside it (squeue and sacct show it as `<array id>_<index>`). The run's log says which job and attempt it
is (`dist.dist_info_from_env`), and so does metrics.json's `environment.slurm`.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any


def _number(value: str | None) -> int | None:
    return int(value) if value is not None and value.isdigit() else None


@dataclass(frozen=True)
class SlurmJob:
    job_id: str  # SLURM_JOB_ID: this job's own id, the same in every attempt (a job array's task has its own)
    array_job_id: str | None  # SLURM_ARRAY_JOB_ID: the array's id, for a task of a job array
    array_index: int | None  # SLURM_ARRAY_TASK_ID
    restart_count: int  # SLURM_RESTART_COUNT: 0 in the first attempt, one more after each requeue
    partition: str | None  # SLURM_JOB_PARTITION
    nodes: str | None  # SLURM_JOB_NODELIST
    tasks: int | None  # SLURM_NTASKS: the job's processes (one per GPU with hydra/launcher=slurm)

    @property
    def name(self) -> str:
        """The job as squeue and sacct name it: `<array id>_<index>` for a task of an array, else its id."""
        if self.array_job_id is not None and self.array_index is not None:
            return f"{self.array_job_id}_{self.array_index}"
        return self.job_id

    @property
    def attempt(self) -> int:
        return self.restart_count + 1

    def fields(self) -> dict[str, Any]:
        """metrics.json's `environment.slurm`: the variables above, and `name` and `attempt`."""
        return {"name": self.name, **asdict(self), "attempt": self.attempt}

    def describe(self) -> str:
        """The log's line, e.g. "Slurm job 12_1 (job id 13), attempt 2 (requeued 1 time), partition debug, ..."."""
        named = f"{self.name} (job id {self.job_id})" if self.name != self.job_id else self.name
        again = f" (requeued {self.restart_count} time{'s' if self.restart_count != 1 else ''})"
        where = f", partition {self.partition}" if self.partition else ""
        tasks = f", {self.tasks} task(s) on {self.nodes}" if self.tasks else ""
        return f"Slurm job {named}, attempt {self.attempt}{again if self.restart_count else ''}{where}{tasks}"


def current_job(environ: Mapping[str, str] = os.environ) -> SlurmJob | None:
    """The Slurm job of this process, or None outside one."""
    job_id = environ.get("SLURM_JOB_ID")
    if not job_id:
        return None
    return SlurmJob(
        job_id=job_id,
        array_job_id=environ.get("SLURM_ARRAY_JOB_ID") or None,
        array_index=_number(environ.get("SLURM_ARRAY_TASK_ID")),
        restart_count=_number(environ.get("SLURM_RESTART_COUNT")) or 0,
        partition=environ.get("SLURM_JOB_PARTITION") or None,
        nodes=environ.get("SLURM_JOB_NODELIST") or None,
        tasks=_number(environ.get("SLURM_NTASKS")),
    )
