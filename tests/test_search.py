"""hparams_search's sweeper (src/hydra_plugins/imgtrain_optuna) on a real Optuna: the search-space grammar, what
Optuna is told of each job, and the search loop with Hydra's launcher replaced by one that returns at once (the
searches through real train.py processes are in test_sweep.py, marked slow)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import yaml
from bounded import within
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.utils import JobReturn, JobStatus
from omegaconf import OmegaConf

from hydra_plugins.imgtrain_optuna.config import Direction
from hydra_plugins.imgtrain_optuna.optuna_search import OptunaSearch, directions_of, objective
from hydra_plugins.imgtrain_optuna.space import search_space
from imgtrain.common.errors import ConfigError, RunEnded
from imgtrain.train.run import NotMeasured

# the search extra: absent on the GPU box, whose `make test-gpu` collects every module
optuna = pytest.importorskip("optuna", reason="hparams_search needs the search extra: pip install -e '.[search]'")
dist = optuna.distributions


def test_the_override_grammar_becomes_optunas_distributions() -> None:
    space = search_space(
        optuna,
        [
            "data.num_workers=choice(0, 2, 4)",
            "data.pin_memory=choice(true, false)",
            "data.prefetch_factor=range(2, 9, 2)",  # 2, 4, 6, 8: the stop is excluded, as in Hydra's basic sweeper
            "optim.lr=tag(log, interval(1e-4, 1e-1))",
            "optim.momentum=interval(0.8, 0.99)",
            "data.batch_size=64",
        ],
    )
    assert space.distributions == {
        "data.num_workers": dist.CategoricalDistribution((0, 2, 4)),
        "data.pin_memory": dist.CategoricalDistribution((True, False)),
        "data.prefetch_factor": dist.IntDistribution(2, 8, step=2),
        "optim.lr": dist.FloatDistribution(1e-4, 1e-1, log=True),
        "optim.momentum": dist.FloatDistribution(0.8, 0.99),
    }
    assert space.fixed == {"data.batch_size": "64"}


def test_a_key_the_command_line_fixes_leaves_the_space() -> None:
    space = search_space(optuna, ["data.num_workers=choice(0, 2)", "data.num_workers=0"])
    assert space.distributions == {} and space.fixed == {"data.num_workers": "0"}


def test_a_quoted_choice_goes_back_to_hydra_as_one_quoted_value() -> None:
    """choice('threads,dataloader') came back as data.engine=threads,dataloader: a comma sweep, which Hydra refuses
    in a job ("Ambiguous value"). Each choice is written back so that Hydra parses the value Optuna drew."""
    line = "x=choice('threads,dataloader', dataloader, 'true', '1', \"it's\", [1,'a,b'], 2, true)"
    space = search_space(optuna, [line, "y='a,b'"])
    drawn = space.distributions["x"].choices
    assert drawn == ("threads,dataloader", "dataloader", "true", "1", "it's", "[1,'a,b']", 2, True)
    parser = OverridesParser.create()
    for value in drawn:
        overrides = parser.parse_overrides(space.overrides({"x": value}))
        assert not any(override.is_sweep_override() for override in overrides)
        parsed = {override.key_or_group: override.value() for override in overrides}
        assert parsed == {"x": [1, "a,b"] if value == "[1,'a,b']" else value, "y": "a,b"}
    assert space.overrides({"x": "dataloader"}) == ["x=dataloader", "y='a,b'"]  # a plain word stays as written


def test_a_quoted_choice_reaches_the_job_as_one_value(tmp_path: Path) -> None:
    params = {"data.engine": "choice('threads,dataloader')"}
    sweeper, launcher = _search(tmp_path, lambda job: 1.0, params=params, n_trials=1, n_jobs=1)
    sweeper.sweep([])
    parsed = OverridesParser.create().parse_overrides(launcher.batches[0][1][0])
    assert [(o.key_or_group, o.value(), o.is_sweep_override()) for o in parsed] == [
        ("data.engine", "threads,dataloader", False)
    ]


@pytest.mark.parametrize(
    ("line", "said"),
    [
        ("x=interval(5, 1)", "x: 'x=interval(5, 1)' cannot be searched: "),
        ("x=tag(log, interval(0, 1))", "x: 'x=tag(log, interval(0, 1))' cannot be searched: "),
        ("x=shuffle(range(0, 1000000000))", "cannot be searched: 1000000000 choices, more than 10000"),
        ("x=choice(1,", "x: 'x=choice(1,' cannot be searched: "),
        ("x=glob(*)", "x: 'x=glob(*)' cannot be searched: "),
        # Optuna takes an infinite bound, and raises OverflowError at the first trial it is asked for
        ("x=interval(0, inf)", "cannot be searched: its bounds are (0.0, inf): expected finite numbers"),
    ],
)
def test_a_space_optuna_cannot_draw_from_is_one_line_naming_the_key(line: str, said: str) -> None:
    with within(5, "the search space"), pytest.raises(ConfigError) as caught:
        search_space(optuna, [line])
    assert str(caught.value).startswith("hydra.sweeper.params.") and said in str(caught.value)
    assert "\n" not in str(caught.value)


def test_directions_are_checked() -> None:
    assert directions_of(Direction.maximize) == ["maximize"]
    assert directions_of(OmegaConf.create(["maximize", "minimize"])) == ["maximize", "minimize"]
    with pytest.raises(ConfigError, match=r"hydra.sweeper.direction=up: expected maximize or minimize"):
        directions_of("up")


def _job(value: Any, status: JobStatus = JobStatus.COMPLETED) -> JobReturn:
    return JobReturn(overrides=[], status=status, _return_value=value)


def test_what_optuna_is_told_of_each_job() -> None:
    assert objective(_job(12.5), 1) == [12.5]
    assert objective(_job([1, 2]), 2) == [1.0, 2.0]
    assert objective(_job(NotMeasured("images_per_sec not measured: 2 steps")), 1).endswith("2 steps")
    assert objective(_job(math.nan), 1) == "the job returned nan: expected 1 finite number(s)"
    assert objective(_job(ValueError("boom\nmore"), JobStatus.FAILED), 1) == "the job failed: ValueError: boom"


class Launcher:
    """Hydra's launcher for these tests: each job returns `value(overrides)` at once."""

    def __init__(self, value: Any) -> None:
        self.value, self.batches = value, []

    def launch(self, overrides: list[list[str]], initial_job_idx: int) -> list[JobReturn]:
        self.batches.append((initial_job_idx, [list(job) for job in overrides]))
        return [_job(self.value(dict(item.split("=", 1) for item in job))) for job in overrides]


def _search(tmp_path: Path, value: Any, **keys: Any) -> tuple[OptunaSearch, Launcher]:
    settings = {"sampler": {"_target_": "optuna.samplers.TPESampler", "seed": 0}, "direction": "maximize"}
    settings |= {"storage": None, "study_name": "t", "n_trials": 5, "n_jobs": 2, "max_failure_rate": 0.0}
    settings |= {"params": {"data.num_workers": "choice(0, 1, 2, 4)", "data.pin_memory": "choice(true, false)"}}
    sweeper = OptunaSearch(**(settings | keys))
    sweeper.sweep_dir, sweeper.launcher = tmp_path, Launcher(value)
    sweeper.validate_batch_is_legal = lambda batch: None  # no Hydra config to compose the jobs against here
    return sweeper, sweeper.launcher


def test_the_search_asks_in_batches_of_n_jobs_and_writes_the_best_trial(tmp_path: Path) -> None:
    sweeper, launcher = _search(tmp_path, lambda job: 10.0 * int(job["data.num_workers"]))
    sweeper.sweep(["data.pin_memory=false"])
    assert [(start, len(jobs)) for start, jobs in launcher.batches] == [(0, 2), (2, 2), (4, 1)]
    assert all("data.pin_memory=False" in job for _, jobs in launcher.batches for job in jobs)
    results = yaml.safe_load((tmp_path / "optimization_results.yaml").read_text())
    tried = {
        int(dict(i.split("=", 1) for i in job)["data.num_workers"]) for _, jobs in launcher.batches for job in jobs
    }
    assert results["best_value"] == 10.0 * max(tried) and results["best_params"] == {"data.num_workers": max(tried)}


def test_trials_without_a_figure_beyond_max_failure_rate_end_in_one_line(tmp_path: Path) -> None:
    why = NotMeasured("images_per_sec not measured: every window is warm-up")
    sweeper, launcher = _search(tmp_path, lambda job: why if job["data.num_workers"] == "0" else 1.0, n_trials=20)
    with pytest.raises(RunEnded) as ended:
        sweeper.sweep(["data.num_workers=0"])
    assert len(launcher.batches) == 1 and ended.value.code == 1
    assert ended.value.line == (
        "error: 2 of 2 trials of a batch had no figure, more than hydra.sweeper.max_failure_rate=0.0 allows; the "
        f"first: {why}: each job's reason is in {tmp_path}/sweep_summary.md"
    )


def test_bad_sweeper_keys_are_one_line_each(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"^hydra.sweeper.max_failure_rate=1.5: expected a fraction in \[0, 1\]$"):
        _search(tmp_path, float, max_failure_rate=1.5)
    sweeper, _ = _search(tmp_path, float, sampler={"_target_": "optuna.samplers.NoSuchSampler"})
    with pytest.raises(ConfigError, match=r"^hydra.sweeper.sampler cannot be built: "):
        sweeper.sweep([])
