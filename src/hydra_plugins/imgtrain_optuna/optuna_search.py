"""hparams_search's sweeper: Optuna's ask-and-tell behind Hydra's Sweeper interface, on a current Optuna (>= 4).

hydra-optuna-sweeper 1.3 pins `optuna<3`, so a user with a current Optuna could not install the search beside it.
This sweeper takes the same keys (config.py) and search-space grammar (space.py), and adds what a measured search
needs: a trial with no figure (too short to measure, or failed: `run.NotMeasured`) is told to Optuna as failed,
with its reason, and the search goes on within `max_failure_rate`; a search without one measured trial, or one
that fails too often, ends with the sweep report and one line, never a traceback.

Optuna is an optional engine (`pip install -e '.[search]'`): Hydra imports this module for every run, so it loads
without Optuna, and a run that asks for the search ends in one line naming the package (host/optional.py).
"""

from __future__ import annotations

import logging
import math
import threading
from collections.abc import Sequence
from enum import Enum
from pathlib import Path
from typing import Any

from hydra.core.plugins import Plugins
from hydra.core.utils import JobReturn
from hydra.plugins.sweeper import Sweeper
from hydra.types import HydraContext, TaskFunction
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf

from hydra_plugins.imgtrain_optuna.config import Direction
from hydra_plugins.imgtrain_optuna.space import SearchSpace, search_space
from imgtrain.common.credentials import masked, url_secrets
from imgtrain.common.errors import EXIT_FAILED, ConfigError, RunEnded, first_line
from imgtrain.host.dist import global_rank
from imgtrain.host.optional import LOAD_ERRORS, require
from imgtrain.sweep.report import build_report

try:
    import optuna
except LOAD_ERRORS:  # the search extra is not installed: `require` says so when a search starts
    optuna = None

log = logging.getLogger(__name__)
NEEDED_BY = "hparams_search (Optuna's search)"
FAILED = "the job failed: "  # how run.NotMeasured, and this module, begin the reason of a job that failed
RESULTS = "optimization_results.yaml"  # the best trial, where hydra-optuna-sweeper wrote it
# Opening the study: a database that does not answer (a host that drops packets, a server that accepts and stays
# silent) ends the search in one line after this long, not after the driver's own wait, which may be none
STORAGE_TIMEOUT_S = 60.0
STORAGE_FROM_ENVIRONMENT = (
    "put the URL in an environment variable and pass hydra.sweeper.storage='${oc.env:OPTUNA_STORAGE}' (or only "
    "the password: postgresql://user:${oc.env:DB_PASSWORD}@host/db)"
)


def directions_of(direction: Any) -> list[str]:
    """`direction` as Optuna's names: one, or a list (one per value the task returns)."""
    given = list(direction) if isinstance(direction, Sequence) and not isinstance(direction, str) else [direction]
    names = [item.name if isinstance(item, Enum) else str(item) for item in given]  # Direction (config.py), as
    # Hydra built it: its plugin scan loads config.py a second time, as a module of another name
    wrong = [name for name in names if name not in Direction.__members__]
    if wrong or not names:
        raise ConfigError(f"hydra.sweeper.direction={direction}: expected maximize or minimize (or a list of them)")
    return names


def objective(job: JobReturn, directions: int) -> list[float] | str:
    """The job's values for Optuna, or why it has none (its NotMeasured reason, or its error)."""
    try:
        value = job.return_value  # re-raises a job's exception (JobStatus.FAILED)
    except Exception as error:  # a bug in a job (run() returns NotMeasured for every error it knows)
        return f"{FAILED}{type(error).__name__}: {first_line(error)}"
    values = value if directions > 1 else [value]
    try:
        floats = [float(value) for value in values]
    except (TypeError, ValueError):
        return str(value)  # run.NotMeasured: the reason, as the job logged it
    if len(floats) != directions or not all(math.isfinite(value) for value in floats):
        return f"the job returned {value!r}: expected {directions} finite number(s)"
    return floats


def refuse_written_password(storage: str | None, config: DictConfig) -> None:
    """ConfigError when a password of the storage URL stands in the config as written: Hydra writes the config
    unresolved into every job's .hydra/hydra.yaml (and the command line's overrides with it), so a password is kept
    out of the job folders only when it comes from the environment, through an interpolation."""
    written = OmegaConf.to_yaml(config)  # what Hydra writes: interpolations such as ${oc.env:...} as they stand
    if storage and any(secret in written for secret in url_secrets(storage)):
        raise ConfigError(
            f"hydra.sweeper.storage={masked(storage, storage)} holds a password, which every job's .hydra/hydra.yaml "
            f"would keep: {STORAGE_FROM_ENVIRONMENT}"
        )


def open_study(storage: str | None, **keys: Any) -> Any:
    """optuna.create_study, its failure one line (a URL SQLAlchemy cannot parse, a driver not installed, a database
    that refuses or does not answer within STORAGE_TIMEOUT_S), the URL's credentials masked in it. A database server
    is opened in a thread this one waits for at most that long; SQLite (a local file, or memory, whose connections
    SQLAlchemy keeps per thread) in this thread, its locks bounded by sqlite's own timeout (5 s)."""
    outcome: dict[str, Any] = {}

    def create() -> None:
        try:
            outcome["study"] = optuna.create_study(storage=storage, **keys)
        except Exception as error:  # noqa: BLE001 - whatever the database or its driver raise: the same one line
            outcome["error"] = error

    if storage is None or str(storage).startswith("sqlite"):
        create()
    else:
        opening = threading.Thread(target=create, name="optuna-storage", daemon=True)  # left behind if it hangs
        opening.start()
        opening.join(STORAGE_TIMEOUT_S)
    if "study" in outcome:
        return outcome["study"]
    shown = masked(str(storage), str(storage))
    error = outcome.get("error")
    why = masked(first_line(error), str(storage)) if error else f"no answer within {STORAGE_TIMEOUT_S:g} s"
    raise ConfigError(
        f"hydra.sweeper.storage={shown}: Optuna cannot open the study there ({why}): expected a database URL that "
        "SQLAlchemy reads, such as sqlite:///search.db, with its driver installed and the database answering"
    )


class OptunaSearch(Sweeper):
    """Ask Optuna for `n_jobs` trials at a time, launch them as Hydra jobs, tell it each job's figure."""

    def __init__(
        self,
        sampler: DictConfig,
        direction: Any,
        storage: str | None,
        study_name: str | None,
        n_trials: int,
        n_jobs: int,
        max_failure_rate: float,
        params: DictConfig | None,
    ) -> None:
        if not 0.0 <= max_failure_rate <= 1.0:
            raise ConfigError(f"hydra.sweeper.max_failure_rate={max_failure_rate}: expected a fraction in [0, 1]")
        if n_trials < 1 or n_jobs < 1:
            raise ConfigError(f"hydra.sweeper.n_trials={n_trials}, n_jobs={n_jobs}: expected 1 or more each")
        self.sampler_conf, self.storage, self.study_name = sampler, storage, study_name
        self.directions = directions_of(direction)
        self.n_trials, self.n_jobs, self.max_failure_rate = n_trials, n_jobs, max_failure_rate
        self.params = {str(key): str(value) for key, value in (params or {}).items()}

    def setup(self, *, hydra_context: HydraContext, task_function: TaskFunction, config: DictConfig) -> None:
        require("optuna", NEEDED_BY)  # one line, before any job, when the extra is missing
        refuse_written_password(self.storage, config)
        self.config, self.hydra_context = config, hydra_context
        self.sweep_dir = Path(config.hydra.sweep.dir)
        self.launcher = Plugins.instance().instantiate_launcher(
            config=config, hydra_context=hydra_context, task_function=task_function
        )

    def _study(self) -> Any:
        try:
            sampler = instantiate(self.sampler_conf) if self.sampler_conf is not None else None
        except Exception as error:  # a sampler Optuna does not have, or a key it does not take
            raise ConfigError(f"hydra.sweeper.sampler cannot be built: {first_line(error)}") from error
        study = open_study(
            study_name=self.study_name,
            storage=self.storage,
            sampler=sampler,
            directions=self.directions,
            load_if_exists=True,  # with a storage, the same command continues the study
        )
        log.info("Study %s (%s), %s", study.study_name, type(study.sampler).__name__, ", ".join(self.directions))
        return study

    def sweep(self, arguments: list[str]) -> None:
        space = search_space(optuna, [f"{key}={value}" for key, value in self.params.items()] + arguments)
        study = self._study()
        launched, reasons = 0, []  # why each trial without a figure has none
        while launched < self.n_trials:
            trials = [study.ask(space.distributions) for _ in range(min(self.n_jobs, self.n_trials - launched))]
            overrides = [self._overrides(trial, space) for trial in trials]
            self.validate_batch_is_legal(overrides)
            jobs = self.launcher.launch(overrides, initial_job_idx=launched)
            launched += len(jobs)
            told = [self._tell(study, trial, job) for trial, job in zip(trials, jobs, strict=True)]
            failed = [reason for reason in told if reason is not None]
            reasons += failed
            if len(failed) > self.max_failure_rate * len(jobs):
                self._end(
                    f"{len(failed)} of {len(jobs)} trials of a batch had no figure, more than "
                    f"hydra.sweeper.max_failure_rate={self.max_failure_rate} allows; the first: {failed[0]}"
                )
        self._write_results(study, reasons)

    @staticmethod
    def _overrides(trial: Any, space: SearchSpace) -> list[str]:
        for key, value in space.fixed.items():
            trial.set_user_attr(key, value)
        return space.overrides(trial.params)

    def _tell(self, study: Any, trial: Any, job: JobReturn) -> str | None:
        """Tell Optuna the job's figure; the reason it has none, after telling Optuna the trial failed."""
        values = objective(job, len(self.directions))
        if isinstance(values, str):
            study.tell(trial, state=optuna.trial.TrialState.FAIL)
            log.warning("trial %d failed: %s", trial.number, values)
            return values
        study.tell(trial, values if len(values) > 1 else values[0])
        return None

    def _end(self, why: str) -> None:
        """The sweep report of the jobs so far, then one line (exit status 1)."""
        if global_rank() == 0:  # inside torchrun every rank runs the search; one report is enough
            build_report(self.sweep_dir)  # each job's row, with its reason
        raise RunEnded(EXIT_FAILED, f"error: {why}: each job's reason is in {self.sweep_dir}/sweep_summary.md")

    def _write_results(self, study: Any, reasons: list[str]) -> None:
        if not any(t.state == optuna.trial.TrialState.COMPLETE for t in study.trials):
            short = [why for why in reasons if not why.startswith(FAILED)]
            self._end(
                "no trial of the search was measured; give each trial more steps (train.max_steps) or fewer warm-up "
                "steps (metrics.skip_first_steps)"
                if short
                else f"no trial of the search was measured: every job failed, the first with: {reasons[0]}"
            )
        if len(self.directions) == 1:
            best = study.best_trial
            results = {"name": "optuna", "best_params": best.params, "best_value": best.value}
            log.info("Best parameters: %s", best.params)
            log.info("Best value: %s", best.value)
        else:
            results = {
                "name": "optuna",
                "solutions": [{"params": t.params, "values": t.values} for t in study.best_trials],
            }
        OmegaConf.save(OmegaConf.create(results), self.sweep_dir / RESULTS)
