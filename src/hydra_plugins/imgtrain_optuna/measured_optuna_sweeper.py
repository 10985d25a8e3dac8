"""hparams_search's sweeper: hydra-optuna-sweeper's, with a search in which no trial was measured ending in the
sweep report and one line, not in Optuna's traceback.

Every unmeasured trial is a failed trial with its reason (run.NotMeasured). When none is measured, Optuna has no
best trial and the plugin's `study.best_trial` raises ("No trials are completed yet") after the jobs, before
Hydra's on_multirun_end, so the report would never be written.

Optuna and its sweeper are an optional engine (`pip install -e '.[search]'`). Hydra imports every module under
hydra_plugins when it starts, for every run: without them this module defines no sweeper, quietly, and a run that
asks for hparams_search ends in one line naming the package (cli.one_line).
"""

from __future__ import annotations

from pathlib import Path

from hydra.types import HydraContext, TaskFunction
from omegaconf import DictConfig

from imgtrain.common.errors import EXIT_FAILED, RunEnded
from imgtrain.host.optional import LOAD_ERRORS
from imgtrain.sweep.report import build_report

try:
    from hydra_plugins.hydra_optuna_sweeper.optuna_sweeper import OptunaSweeper
except LOAD_ERRORS:  # the search extra is not installed: no sweeper here (see the module docstring)
    OptunaSweeper = None


class _MeasuredSweep:
    """What MeasuredOptunaSweeper adds to OptunaSweeper: when the search ends without a single measured trial, the
    report and one line naming why; any other error is the plugin's own. (A mixin, so that this module imports
    where OptunaSweeper does not.)"""

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


if OptunaSweeper is not None:

    class MeasuredOptunaSweeper(_MeasuredSweep, OptunaSweeper):
        """hparams_search's sweeper: OptunaSweeper, with a search without a measured trial ending in its report."""
