"""The keys of hparams_search's sweeper (`hydra.sweeper.*`): those of hydra-optuna-sweeper, whose search this
plugin replaces on a current Optuna (>= 4), so that a search written for it runs here unchanged.

Registered as `hydra/sweeper=imgtrain_optuna` when Hydra loads its plugins (every run: nothing here imports
Optuna). The sampler stays a config until the sweeper builds it (`_recursive_` off), so that a run without Optuna
ends in the one line of `host/optional.py`, not in Hydra's instantiation error. (No `from __future__ import
annotations`: Hydra's plugin scan loads this module outside sys.modules, where dataclasses cannot resolve string
annotations.)
"""

from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from hydra.core.config_store import ConfigStore


class Direction(Enum):
    """Whether the objective (`optimized_metric`, images/s for hparams_search=loader) is to grow or shrink."""

    maximize = 1
    minimize = 2


@dataclass
class TPESamplerConf:
    """Optuna's default sampler: random for its first 10 trials, then guided by the trials so far."""

    _target_: str = "optuna.samplers.TPESampler"
    seed: int | None = None  # the same seed, the same trials in the same order


@dataclass
class OptunaSearchConf:
    _target_: str = "hydra_plugins.imgtrain_optuna.optuna_search.OptunaSearch"
    _recursive_: bool = False  # the sweeper builds the sampler once Optuna is known to be importable
    sampler: Any = field(default_factory=TPESamplerConf)  # any Optuna sampler that takes no search space
    direction: Any = Direction.maximize  # or a list of directions, one per value the task returns
    storage: str | None = None  # e.g. sqlite:///search.db: a rerun with the same study_name continues the study
    study_name: str | None = None
    n_trials: int = 20  # trials in all
    n_jobs: int = 2  # trials asked for, and launched, together (in parallel with a parallel launcher)
    # The largest share of a batch of trials that may fail (no figure) before the search ends; 1.0: never.
    max_failure_rate: float = 0.0
    # key -> a sweep in Hydra's override grammar: choice(...), range(...), interval(...), tag(log, interval(...))
    params: dict[str, str] | None = None


ConfigStore.instance().store(group="hydra/sweeper", name="imgtrain_optuna", node=OptunaSearchConf, provider="imgtrain")
