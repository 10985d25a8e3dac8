"""The errors a user can act on. Hydra prints them as one line; `cli` maps them to exit statuses."""

from __future__ import annotations

from hydra.errors import CompactHydraException


class RunError(CompactHydraException):
    """A failure the user can act on, printed as one line without a traceback (unless HYDRA_FULL_ERROR=1)."""


class ConfigError(RunError):
    """A bad setting: detected before any work starts (exit status 2)."""
