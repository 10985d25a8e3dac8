"""Entry point: `python train.py [overrides]`, `python train.py -m ...` or `torchrun ... train.py ...`."""

import sys

import hydra
from omegaconf import DictConfig

from imgtrain.train.cli import one_line_errors, register, run_guarded
from imgtrain.train.run import run

register()


@hydra.main(version_base="1.3", config_path="conf", config_name="config")
def main(cfg: DictConfig) -> float | str:
    """Train with the composed config; return the metric a sweeper optimises (or, as text, why there is none)."""
    with one_line_errors():  # bad input or a failure: one `error:` line and its exit status
        return run(cfg)


if __name__ == "__main__":  # the guard `spawn`/`forkserver` DataLoader workers need when they re-import this
    sys.exit(run_guarded(main))
