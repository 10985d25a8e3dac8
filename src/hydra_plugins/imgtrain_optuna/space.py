"""A search space written in Hydra's override grammar, as Optuna distributions: `choice(0, 2, 4)` a categorical,
`range(1, 9, 2)` and `interval(1, 8)` integers or floats by their bounds, `tag(log, interval(1e-4, 1e-1))` on a
log scale; a plain value (`data.num_workers=0` on the command line) fixes the key and leaves the space.

Meaning for meaning hydra-optuna-sweeper's, on the distributions of Optuna >= 3 (IntDistribution and
FloatDistribution, which replace the five it used); `optuna` is the module, passed in by the one caller that has
imported it (the extra is optional). A trial's values go back to Hydra as overrides that parse to the same values:
`choice('threads,dataloader')` stays one quoted string, never a comma sweep.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.override_parser.types import IntervalSweep, Override, Quote, QuotedString, RangeSweep
from hydra.errors import HydraException

from imgtrain.common.errors import ConfigError, first_line

MAX_CHOICES = 10_000  # a categorical's choices: shuffle(range(...)) lists every one before the search starts
_PARSER = OverridesParser.create()


@dataclass
class SearchSpace:
    """What the search draws (`distributions`), what it fixes (`fixed`: each value as written), and how each
    categorical choice is written back (`choices`: the override text of each, in the distribution's order)."""

    distributions: dict[str, Any] = field(default_factory=dict)
    fixed: dict[str, str] = field(default_factory=dict)
    choices: dict[str, list[str]] = field(default_factory=dict)

    def overrides(self, params: dict[str, Any]) -> list[str]:
        """A trial's `params`, then the fixed values, as overrides that parse back to the same values."""
        drawn = {key: self._text(key, value) for key, value in params.items()}
        return [f"{key}={value}" for key, value in {**drawn, **self.fixed}.items()]

    def _text(self, key: str, value: Any) -> str:
        if key in self.choices:
            return self.choices[key][int(self.distributions[key].to_internal_repr(value))]
        return Override._get_value_element_as_str(value)  # a number: its literal


def _as_written(text: str) -> str:
    """A string as an override's value that parses back to that string: as it is where Hydra reads it so (a plain
    word), else quoted (commas, brackets, 'true', '1', spaces at either end)."""
    try:
        parsed = _PARSER.parse_override(f"k={text}")
        if not parsed.is_sweep_override() and parsed.value() == text and isinstance(parsed.value(), str):
            return text
    except HydraException:
        pass
    return QuotedString(text=text, quote=Quote.single).with_quotes()


def _choice(element: Any) -> tuple[Any, str]:
    """A parsed choice as (Optuna's value, its override text): strings and numbers as themselves, lists and dicts
    as their text (Optuna's choices are plain values)."""
    if isinstance(element, QuotedString):
        return element.text, element.with_quotes()
    if isinstance(element, str):
        return element, _as_written(element)
    text = Override._get_value_element_as_str(element)
    return (element if element is None or isinstance(element, (bool, int, float)) else text), text


def _numeric(optuna: ModuleType, start: Any, end: Any, step: Any = None, log: bool = False) -> Any:
    """Integers when every bound (and the step) is an int, else floats; finite ones only (Optuna takes an infinite or
    NaN bound, and fails on it at the first trial)."""
    if not all(math.isfinite(bound) for bound in (start, end, step) if bound is not None):
        raise ValueError(
            f"its bounds are ({start}, {end}{'' if step is None else f', step {step}'}): expected finite numbers"
        )
    dist = optuna.distributions
    if all(isinstance(bound, int) for bound in (start, end, step) if bound is not None):
        return dist.IntDistribution(int(start), int(end), log=log, step=1 if step is None else int(step))
    return dist.FloatDistribution(float(start), float(end), log=log, step=None if step is None else float(step))


def _count(value: RangeSweep) -> int:
    step = value.step or 1
    if not all(math.isfinite(bound) for bound in (value.start, value.stop, step)):
        raise ValueError(f"range({value.start}, {value.stop}, {step}): expected finite numbers")
    return max(0, math.ceil((value.stop - value.start) / step))


def distribution(optuna: ModuleType, override: Override) -> tuple[Any, list[str]]:
    """The Optuna distribution of a sweep override and, for a categorical, each choice's override text; for a plain
    override its value as written, and no texts."""
    if not override.is_sweep_override():
        return override.get_value_element_as_str(), []
    value = override.value()
    if override.is_choice_sweep() or (isinstance(value, RangeSweep) and value.shuffle):
        if isinstance(value, RangeSweep) and _count(value) > MAX_CHOICES:
            raise ValueError(f"{_count(value)} choices, more than {MAX_CHOICES}")
        pairs = [_choice(element) for element in override.sweep_iterator()]
        if not pairs or len(pairs) > MAX_CHOICES:
            raise ValueError(f"{len(pairs)} choices: expected 1 to {MAX_CHOICES}")
        values, texts = [pair[0] for pair in pairs], [pair[1] for pair in pairs]
        # Optuna finds a choice by == (list.index): to it 1, 1.0 and true are one choice, and a trial that drew true
        # ran with 1. Where two choices are equal but written differently, Optuna's values are the texts.
        seen: dict[Any, str] = {}
        if any(seen.setdefault(value, text) != text for value, text in pairs):
            values = texts
        return optuna.distributions.CategoricalDistribution(values), texts
    # range(start, stop, step): the stop excluded, as Hydra's grammar and basic sweeper do (hydra-optuna-sweeper
    # 1.x included it)
    if isinstance(value, RangeSweep):
        step, count = value.step or 1, _count(value)
        last = value.start + step * max(0, count - 1)
        return _numeric(optuna, value.start, last, step), []
    if isinstance(value, IntervalSweep):
        return _numeric(optuna, value.start, value.end, log="log" in value.tags), []
    raise ValueError("expected choice(...), range(...), interval(...) or tag(log, interval(...))")


def search_space(optuna: ModuleType, overrides: list[str]) -> SearchSpace:
    """The distributions and the fixed values of `overrides` (the sweeper's params, then the command line: a key
    the command line fixes is no longer searched). A value that is no search space: ConfigError naming it."""
    space = SearchSpace()
    for line in overrides:
        try:
            override = _PARSER.parse_override(line)
            value, texts = distribution(optuna, override)
        # Optuna's own checks: ValueError; its arithmetic on the bounds: ArithmeticError (OverflowError, decimal's
        # InvalidOperation for range(0, 1e308, 1e-308))
        except (HydraException, ValueError, TypeError, ArithmeticError) as error:
            key = line.split("=", 1)[0]
            raise ConfigError(f"hydra.sweeper.params.{key}: {line!r} cannot be searched: {first_line(error)}") from None
        key = override.get_key_element()
        for part in (space.distributions, space.fixed, space.choices):
            part.pop(key, None)
        if isinstance(value, str):
            space.fixed[key] = value
        else:
            space.distributions[key] = value
            space.choices.update({key: texts} if texts else {})
    return space
