"""A search space written in Hydra's override grammar, as Optuna distributions: `choice(0, 2, 4)` a categorical,
`range(1, 9, 2)` and `interval(1, 8)` integers or floats by their bounds, `tag(log, interval(1e-4, 1e-1))` on a
log scale; a plain value (`data.num_workers=0` on the command line) fixes the key and leaves the space.

Meaning for meaning hydra-optuna-sweeper's, on the distributions of Optuna >= 3 (IntDistribution and
FloatDistribution, which replace the five it used); `optuna` is the module, passed in by the one caller that has
imported it (the extra is optional).
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.override_parser.types import IntervalSweep, Override, RangeSweep, Transformer

from imgtrain.common.errors import ConfigError


def _numeric(optuna: ModuleType, start: Any, end: Any, step: Any = None, log: bool = False) -> Any:
    """Integers when every bound (and the step) is an int, else floats."""
    dist = optuna.distributions
    if all(isinstance(bound, int) for bound in (start, end, step) if bound is not None):
        return dist.IntDistribution(int(start), int(end), log=log, step=1 if step is None else int(step))
    return dist.FloatDistribution(float(start), float(end), log=log, step=None if step is None else float(step))


def distribution(optuna: ModuleType, override: Override) -> Any:
    """The Optuna distribution of a sweep override, or the value string of a plain one."""
    if not override.is_sweep_override():
        return override.get_value_element_as_str()
    value = override.value()
    if override.is_choice_sweep() or (isinstance(value, RangeSweep) and value.shuffle):
        return optuna.distributions.CategoricalDistribution(
            list(override.sweep_iterator(transformer=Transformer.encode))  # lists and dicts as their text
        )
    # range(start, stop, step): the stop excluded, as Hydra's grammar and basic sweeper do (hydra-optuna-sweeper
    # 1.x included it)
    if isinstance(value, RangeSweep):
        step = value.step or 1
        last = value.start + step * max(0, -(-(value.stop - value.start) // step) - 1)
        return _numeric(optuna, value.start, last, step)
    if isinstance(value, IntervalSweep):
        return _numeric(optuna, value.start, value.end, log="log" in value.tags)
    raise ConfigError(
        f"hydra.sweeper.params.{override.get_key_element()}: {override.input_line!r} cannot be searched: "
        "expected choice(...), range(...), interval(...) or tag(log, interval(...))"
    )


def search_space(optuna: ModuleType, overrides: list[str]) -> tuple[dict[str, Any], dict[str, str]]:
    """The distributions and the fixed values of `overrides` (the sweeper's params, then the command line: a key
    the command line fixes is no longer searched)."""
    space: dict[str, Any] = {}
    fixed: dict[str, str] = {}
    for override in OverridesParser.create().parse_overrides(overrides):
        key = override.get_key_element()
        value = distribution(optuna, override)
        space.pop(key, None)
        fixed.pop(key, None)
        (fixed if isinstance(value, str) else space)[key] = value
    return space, fixed
