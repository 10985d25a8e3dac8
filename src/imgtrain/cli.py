"""Error presentation for the command line: bad input gets one clear line, not a traceback."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable

from hydra.errors import HydraException
from omegaconf.errors import OmegaConfBaseException

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


def one_line(error: BaseException) -> str:
    """Collapse a Hydra/OmegaConf error (and its cause) into one line that keeps the key and the choices."""
    from imgtrain.config import ConfigError

    inner: BaseException | None = error
    while inner is not None:  # our own message, even when wrapped (e.g. by hydra.utils.instantiate)
        if isinstance(inner, ConfigError):
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


def run_guarded(main: Callable[[], object]) -> int:
    """Run a `@hydra.main` function; config errors print one line to stderr and exit with status 2.

    HYDRA_FULL_ERROR=1 (set by the user) keeps Hydra's full traceback, as Hydra documents.
    """
    if os.environ.get("HYDRA_FULL_ERROR") == "1":
        main()
        return 0
    # Ask Hydra to re-raise instead of printing its own multi-line report, so it can be shortened here.
    os.environ["HYDRA_FULL_ERROR"] = "1"
    try:
        main()
    except (HydraException, OmegaConfBaseException) as error:
        print(f"error: {one_line(error)}", file=sys.stderr, flush=True)
        return 2
    finally:
        os.environ.pop("HYDRA_FULL_ERROR", None)
    return 0
