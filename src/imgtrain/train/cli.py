"""Error presentation for the command line: every early end is one line on stderr and an exit status."""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import traceback
from collections.abc import Callable, Iterator

from hydra.errors import HydraException
from omegaconf.errors import OmegaConfBaseException

from imgtrain.common.errors import EXIT_BAD_INPUT, RunEnded, RunError
from imgtrain.config.renamed_keys import moved_key_line
from imgtrain.config.schema import register_configs
from imgtrain.host.dist import register_resolvers

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

# Values a key took before it became a choice: the one line says what they are now (the choice lists the rest).
FORMER_VALUES = {
    "dataset.augment=false": "dataset.augment=none",
    "dataset.augment=true": "dataset.augment=rrc_flip",
}


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
    message = f"{error}\n{error.__cause__ or ''}"
    moved = moved_key_line(message)
    if moved is not None:  # a key of the former trainer group: where it lives now
        return moved
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
    former = next((old for old in FORMER_VALUES if f"override {old}\n" in message.lower()), None)
    return f"{former} is now {FORMER_VALUES[former]}; {text}" if former else text


@contextlib.contextmanager
def one_line_errors() -> Iterator[None]:
    """Wrap the task function's body: an error with a one-line message (Hydra's, OmegaConf's, our RunError)
    leaves as `RunEnded`, past Hydra's "Error executing job" report. Other exceptions are bugs: they keep their
    traceback."""
    try:
        yield
    except (HydraException, OmegaConfBaseException) as error:
        raise RunEnded.from_error(error, one_line(error)) from error


_OUTSIDE_TRAINING = (
    "Ctrl-C outside the training loop (while starting up or finishing): nothing new was saved. Run the same "
    "command again to start, or to resume from the last checkpoint"
)


def run_guarded(main: Callable[[], object]) -> int:
    """Run a `@hydra.main` function and return its exit status (`errors` lists them); every early end prints
    one line to stderr: a `RunEnded`, a Ctrl-C outside the training loop, or a composition error.

    Hydra reports composition errors (an unknown key, a bad option, a value of the wrong type) itself, before
    any task code runs, in several lines with exit status 1, unless HYDRA_FULL_ERROR=1: its documented switch
    to re-raise them. So it is set while Hydra runs, and restored after. A user who sets it gets the Python
    traceback of every error as well, as Hydra documents.
    """
    traceback_asked = os.environ.get("HYDRA_FULL_ERROR") == "1"
    os.environ["HYDRA_FULL_ERROR"] = "1"
    try:
        main()
    except RunEnded as ended:
        if traceback_asked and ended.__cause__ is not None:
            traceback.print_exception(ended.__cause__)
        print(ended.line, file=sys.stderr, flush=True)
        return int(ended.code)
    except KeyboardInterrupt:  # Ctrl-C before or after the training loop, where the stop handler is not installed
        print(f"stopped: {_OUTSIDE_TRAINING}", file=sys.stderr, flush=True)
        return 128 + signal.SIGINT
    except (HydraException, OmegaConfBaseException) as error:  # composing the config, before the task function
        if traceback_asked:
            raise
        print(f"error: {one_line(error)}", file=sys.stderr, flush=True)
        return EXIT_BAD_INPUT
    finally:
        if not traceback_asked:
            os.environ.pop("HYDRA_FULL_ERROR", None)
    return 0
