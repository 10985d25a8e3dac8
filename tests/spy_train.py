"""`train.py`, recording which training samples each process of a dataset=shards run reads: one line per sample,
"<rank> <LitData epoch> <LitData index>", in $SPY_DIR/<pid>.txt. Run by the DDP test under torchrun."""

import os
import sys
from pathlib import Path

import hydra
from omegaconf import DictConfig

from imgtrain.data.shards.dataset import ShardSplit
from imgtrain.train.cli import one_line_errors, register, run_guarded
from imgtrain.train.run import run

CONF = Path(__file__).resolve().parents[1] / "conf"

_read = ShardSplit.__getitem__


def _spied(self: ShardSplit, index):
    sample = _read(self, index)
    if self.train and hasattr(index, "chunk_index"):  # a sample of LitData's training order
        with open(Path(os.environ["SPY_DIR"]) / f"{os.getpid()}.txt", "a") as out:
            out.write(f"{os.environ.get('RANK', '0')} {self.current_epoch} {index.index}\n")
    return sample


ShardSplit.__getitem__ = _spied
register()


@hydra.main(version_base="1.3", config_path=str(CONF), config_name="config")
def main(cfg: DictConfig) -> float:
    with one_line_errors():
        return run(cfg)


if __name__ == "__main__":
    sys.exit(run_guarded(main))
