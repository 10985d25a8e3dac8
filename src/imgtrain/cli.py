"""Error presentation for the command line: bad input gets one clear line, not a traceback."""

from __future__ import annotations

import contextlib
import os
import signal
import sys
from collections.abc import Callable, Iterator

from hydra.errors import HydraException
from omegaconf.errors import OmegaConfBaseException

from imgtrain.config import register_configs
from imgtrain.dist import register_resolvers
from imgtrain.errors import ConfigError, RunError
from imgtrain.faults import Preempted
from imgtrain.rundir import Refused

# Lines of OmegaConf/Hydra messages that repeat what the first line says, or point at internals.
_NOISE = (
    "full_key:",
    "reference_type=",
    "object_type=",
    "Set the environment variable",
    "To append to your",
    "Config search path",
    "provider=",
)


def register() -> None:
    """What `train.py` and the tests need before Hydra composes: the schemas and the run-directory resolvers."""
    register_configs()
    register_resolvers()


def one_line(error: BaseException) -> str:
    """Collapse a Hydra/OmegaConf error (and its cause) into one line that keeps the key and the choices."""
    inner: BaseException | None = error
    while inner is not None:  # our own message, even when wrapped (e.g. by hydra.utils.instantiate)
        if isinstance(inner, RunError):
            return str(inner)
        inner = inner.__cause__
    parts: list[str] = []
    options: list[str] = []
    for exc in (error, error.__cause__):
        if exc is None:
            continue
        in_options = False
        for raw in str(exc).splitlines():
            line = raw.strip()
            if not line or line.startswith(_NOISE):
                continue
            if line.startswith("Available options in"):
                in_options = True
                parts.append(line)
            elif in_options and raw.startswith(("\t", " ")):
                if not line.startswith("base_"):  # schemas registered in the ConfigStore, not user choices
                    options.append(line)
            elif line not in parts:
                in_options = False
                parts.append(line)
    text = ": ".join(part.rstrip(".:") for part in parts)
    if options:
        text = f"{text}: {', '.join(options)}"
    return text


def _is_run_failure(error: BaseException) -> bool:
    """A failure during training (exit status 1), as opposed to bad input (status 2)."""
    inner: BaseException | None = error
    while inner is not None:
        if isinstance(inner, RunError):
            return not isinstance(inner, ConfigError)
        inner = inner.__cause__
    return False


class _Escalated(BaseException):
    """Carries an error out of the task function past Hydra's "Error executing job" report (it catches Exception)."""

    def __init__(self, error: BaseException) -> None:
        super().__init__(str(error))
        self.error = error


_OUTSIDE_TRAINING = (
    "Ctrl-C outside the training loop (while starting up or finishing): nothing new was saved. Run the same "
    "command again to start, or to resume from the last checkpoint"
)

_guarded = False  # run_guarded is in charge of printing errors (the user did not ask for HYDRA_FULL_ERROR)


@contextlib.contextmanager
def escalate_errors() -> Iterator[None]:
    """Wrap the task function's body: errors with a one-line message reach run_guarded without Hydra's extra line."""
    try:
        yield
    except (HydraException, OmegaConfBaseException) as error:
        if not _guarded:
            raise
        raise _Escalated(error) from error


def run_guarded(main: Callable[[], object]) -> int:
    """Run a `@hydra.main` function; errors the user can act on print one line to stderr.

    Exit status: 2 for bad input (config, paths), 1 for a failure during training (bad data, NaN loss, a
    DataLoader crash), 128 + N after stop signal N (checkpoint saved; schedulers treat it as requeue-able; Ctrl-C
    is SIGINT: 130).
    HYDRA_FULL_ERROR=1 (set by the user) keeps Hydra's full traceback, as Hydra documents.
    """
    if os.environ.get("HYDRA_FULL_ERROR") == "1":
        try:
            main()
        except Preempted as stop:
            print(f"stopped: {stop}", file=sys.stderr, flush=True)
            return stop.exit_code
        except KeyboardInterrupt:
            print(f"stopped: {_OUTSIDE_TRAINING}", file=sys.stderr, flush=True)
            return 128 + signal.SIGINT
        except Refused as refused:
            print(f"error: {refused.error}", file=sys.stderr, flush=True)
            return 2 if isinstance(refused.error, ConfigError) else 1
        return 0
    # Ask Hydra to re-raise instead of printing its own multi-line report, so it can be shortened here.
    global _guarded
    os.environ["HYDRA_FULL_ERROR"] = "1"
    _guarded = True
    try:
        main()
    except Preempted as stop:
        print(f"stopped: {stop}", file=sys.stderr, flush=True)
        return stop.exit_code
    except KeyboardInterrupt:  # Ctrl-C before or after the training loop, where the stop handler is not installed
        print(f"stopped: {_OUTSIDE_TRAINING}", file=sys.stderr, flush=True)
        return 128 + signal.SIGINT
    except Refused as refused:  # the run directory's lock, taken before the job starts (rundir.LockRunDir)
        print(f"error: {refused.error}", file=sys.stderr, flush=True)
        return 2 if isinstance(refused.error, ConfigError) else 1
    except (_Escalated, HydraException, OmegaConfBaseException) as caught:
        error = caught.error if isinstance(caught, _Escalated) else caught
        print(f"error: {one_line(error)}", file=sys.stderr, flush=True)
        return 1 if _is_run_failure(error) else 2
    finally:
        os.environ.pop("HYDRA_FULL_ERROR", None)
        _guarded = False
    return 0
