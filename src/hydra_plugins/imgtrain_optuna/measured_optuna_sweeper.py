"""hparams_search's sweeper: hydra-optuna-sweeper's, with a search in which no trial was measured ending in the
sweep report and one line, not in Optuna's traceback.

Every unmeasured trial is a failed trial with its reason (run.NotMeasured). When none is measured, Optuna has no
best trial and the plugin's `study.best_trial` raises ("No trials are completed yet") after the jobs, before
Hydra's on_multirun_end, so the report would never be written.
"""

from __future__ import annotations

from pathlib import Path

from hydra.types import HydraContext, TaskFunction
from hydra_plugins.hydra_optuna_sweeper.optuna_sweeper import OptunaSweeper
from omegaconf import DictConfig

from imgtrain.errors import EXIT_FAILED, RunEnded
from imgtrain.sweep_report import build_report


class MeasuredOptunaSweeper(OptunaSweeper):
    """OptunaSweeper that, when the search ends without a single measured trial, writes the report and ends
    with one line naming why; any other error is the plugin's own."""

    def setup(self, *, hydra_context: HydraContext, task_function: TaskFunction, config: DictConfig) -> None:
        self.sweep_dir = Path(config.hydra.sweep.dir)
        super().setup(hydra_context=hydra_context, task_function=task_function, config=config)

    def sweep(self, arguments: list[str]) -> None:
        try:
            return super().sweep(arguments)
        except ValueError as error:
            best = build_report(self.sweep_dir)  # the jobs' rows, each with its reason
            if best is not None or not any(self.sweep_dir.glob("*/metrics.json")):
                raise  # a measured job exists, or no job finished: not the case this class is for
            raise RunEnded(
                EXIT_FAILED,
                f"error: no trial of the search was measured ({error}): each job's reason is in the report above "
                f"and in {self.sweep_dir}/sweep_summary.md; give each trial more steps (train.max_steps) or fewer "
                "warm-up steps (metrics.skip_first_steps)",
            ) from error
