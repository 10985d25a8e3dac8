"""The errors a user can act on, and the one way a run ends early: `RunEnded`, printed and mapped to an exit
status by `cli.run_guarded`.

Exit statuses: 0 finished; 1 a failure during training (bad data, a NaN loss, a dead DataLoader worker); 2 bad
input (a config value, a path), found before any work starts; 128 + N stopped by signal N with a checkpoint saved
(Ctrl-C is SIGINT: 130), the shell's convention that SLURM and torchrun read as "ended by a signal".
"""

from __future__ import annotations

from hydra.errors import CompactHydraException

EXIT_FAILED = 1
EXIT_BAD_INPUT = 2


class RunError(CompactHydraException):
    """A failure the user can act on, printed as one line without a traceback (unless HYDRA_FULL_ERROR=1)."""


class ConfigError(RunError):
    """A bad setting: detected before any work starts (exit status 2)."""


class RunEnded(SystemExit):
    """A run ends here: `line` is what stderr gets, `code` the exit status.

    A SystemExit because that is the one exception Hydra lets pass unchanged with its status (Python documents
    it as the way to exit with a status): Hydra's job runner and its error report catch `Exception`, print
    "Error executing job" with a traceback and exit 1, and its callbacks turn an `Exception` into a warning. It
    also ends a multirun, which a stop signal should. `__cause__` keeps the original error for HYDRA_FULL_ERROR=1.
    """

    def __init__(self, code: int, line: str) -> None:
        super().__init__(code)
        self.line = line

    @classmethod
    def from_error(cls, error: BaseException, line: str) -> RunEnded:
        """The end for `error`: status 2 for bad input, 1 for a failure during training; `line` describes it."""
        code = EXIT_BAD_INPUT if is_bad_input(error) else EXIT_FAILED
        ended = cls(code, f"error: {line}")
        ended.__cause__ = error
        return ended


def first_line(error: BaseException) -> str:
    """The first line of an exception's message, or its type's name when it has none."""
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


def is_bad_input(error: BaseException) -> bool:
    """Bad input (exit status 2) rather than a failure during training (1): a ConfigError, or an error of Hydra or
    OmegaConf (composition, interpolation) that is not wrapping a RunError raised while running."""
    inner: BaseException | None = error
    while inner is not None:
        if isinstance(inner, RunError):
            return isinstance(inner, ConfigError)
        inner = inner.__cause__
    return True
