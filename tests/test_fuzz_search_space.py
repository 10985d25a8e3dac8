"""Fuzz target for the search space hparams_search writes in Hydra's override grammar (hydra_plugins/imgtrain_optuna/
space.py), seeded from fuzz_seeds/search_space/overrides.txt (the params of conf/hparams_search/, and crafted lines:
quoted choices, lists and dicts as choices, shuffles, reversed and float ranges, empty and NaN intervals, a shuffle
of a billion, globs, interpolations, a line cut short). The properties:
- any line ends in a space or in ConfigError (one line naming hydra.sweeper.params.<key>), within the bound: a
  space Optuna cannot draw from, or one too large to list, is refused before the search starts;
- every value the space can give a trial goes back to Hydra as an override that is no sweep and parses to the value
  the line gave it (each choice, each bound of a range or interval), and a fixed value parses as the line wrote it.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from fuzzing import SEEDS, bounded, fast, mutated, slow
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.override_parser.types import ChoiceSweep, Override
from hypothesis import given

from hydra_plugins.imgtrain_optuna.space import search_space
from imgtrain.common.errors import ConfigError

optuna = pytest.importorskip("optuna", reason="hparams_search needs the search extra: pip install -e '.[search]'")
LINES = (SEEDS / "search_space" / "overrides.txt").read_text().splitlines()
PARSER = OverridesParser.create()


def _parsed(text: str) -> Override:
    override = PARSER.parse_override(f"k={text}")
    assert not override.is_sweep_override(), text
    return override


def _same(a: object, b: object) -> bool:
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    return a == b and type(a) is type(b)


def space_target(line: str) -> None:
    try:
        with bounded("building the search space"):
            space = search_space(optuna, [line])
    except ConfigError as error:
        assert "\n" not in str(error) and str(error).startswith("hydra.sweeper.params."), error
        return
    original = PARSER.parse_override(line)
    for key, distribution in space.distributions.items():
        if key in space.choices:
            value = original.value()
            if not (isinstance(value, ChoiceSweep) and not value.shuffle):
                continue  # a shuffled order: the choices are the line's, in another order
            expected = [Override._convert_value(element) for element in original.sweep_iterator()]
            for drawn, want in zip(distribution.choices, expected, strict=True):
                (override,) = PARSER.parse_overrides(space.overrides({key: drawn}))
                assert not override.is_sweep_override() and _same(override.value(), want), (drawn, want)
        else:
            for bound in (distribution.low, distribution.high):
                (override,) = PARSER.parse_overrides(space.overrides({key: bound}))
                assert _same(override.value(), bound), (override.value(), bound)
    for text in space.fixed.values():
        assert _parsed(text).value() == original.value(), (text, original.value())
    with bounded("a trial"):  # what a search asks for, as Hydra gets it
        trial = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=0)).ask(space.distributions)
        for override in PARSER.parse_overrides(space.overrides(trial.params)):
            assert not override.is_sweep_override(), override


LINE_BYTES = [line.encode() for line in LINES]
MUTATED = mutated(LINE_BYTES).map(lambda data: data.decode("utf-8", "ignore").replace("\n", " ").replace("\r", " "))


@fast()
@given(MUTATED)
def test_any_line_is_a_space_that_goes_back_as_written_or_one_line(line: str) -> None:
    space_target(line)


@pytest.mark.parametrize("line", LINES)
def test_each_seed_line(line: str) -> None:
    space_target(line)


def test_the_shipped_searches_are_spaces() -> None:
    """conf/hparams_search/*.yaml's params (seed lines) are spaces, none refused."""
    shipped = [line for line in LINES if line.startswith(("data.", "optim.", "train."))]
    assert len(shipped) >= 9
    for line in shipped:
        search_space(optuna, [line])


@pytest.mark.slow  # a minute: the target on SLOW examples
def test_the_search_space_target_on_a_larger_budget(tmp_path: Path) -> None:
    slow()(given(MUTATED)(space_target))()
