"""YAML read from a file someone else may have written (a checkpoint's settings, a sweep job's overrides): plain data
only (PyYAML's SafeLoader), and no aliases. Neither OmegaConf nor Hydra writes an alias, and a few hundred bytes of
them make a value whose walk never ends (one list shared ten times at each of nine levels: a billion items) or one
that holds itself (a RecursionError in whatever walks it)."""

from __future__ import annotations

from typing import Any

import yaml


class _PlainLoader(yaml.SafeLoader):
    def compose_node(self, parent: Any, index: Any) -> Any:
        if self.check_event(yaml.AliasEvent):
            mark = self.peek_event().start_mark
            raise yaml.composer.ComposerError(None, None, "an alias (*name), which no imgtrain file holds", mark)
        return super().compose_node(parent, index)


def load_plain(text: str) -> Any:
    """The YAML value of `text`; yaml.YAMLError when it is not YAML or holds an alias (RecursionError when it is
    nested deeper than Python's recursion limit, as yaml.safe_load raises it)."""
    return yaml.load(text, Loader=_PlainLoader)  # a SafeLoader: plain data only
