"""Splits that a streaming engine orders and reads itself (dataset=shards: LitData), as the run sees them.

The run builds, positions, checkpoints and closes their loaders through these two classes alone, so it imports no
engine: LitData and boto3 are imported only by a run that streams (data/shards/, built by Hydra from
`dataset._target_`), and a run on a folder, CIFAR or synthetic data works where they are not installed.
"""

from __future__ import annotations

import weakref
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any

from imgtrain.data.loader import LoaderPlan


class StreamedLoader(ABC):
    """The loader of a StreamedSplit. No sampler: the engine deals the samples to the ranks and their workers."""

    sampler = None
    replicas: int  # ranks the order is dealt over

    @abstractmethod
    def start_epoch(self, epoch: int, samples_done: int) -> None:
        """Position the loader at epoch `epoch` (from 0), `samples_done` samples (over all ranks) into it."""

    @abstractmethod
    def state_dict(self) -> dict[str, int] | None:
        """What a checkpoint keeps of the order (the epoch and the topology it started with)."""

    @abstractmethod
    def load_state_dict(self, state: dict[str, int] | None) -> None: ...

    @abstractmethod
    def close(self) -> None:
        """Stop the loader's workers now."""


class StreamedSplit(ABC):
    """A split whose engine makes its own loader (`build_loader`) with the plan's DataLoader arguments. `len()` is
    what the engine deals out for a topology; `samples` is what the split stores."""

    @property
    @abstractmethod
    def samples(self) -> int:
        """The samples the split stores."""

    @abstractmethod
    def build_loader(
        self,
        plan: LoaderPlan,
        *,
        train: bool,
        seed: int,
        rank: int,
        world_size: int,
        replan: Callable[[int], LoaderPlan] | None = None,
    ) -> StreamedLoader:
        """`replan(workers)`: the plan with another worker count (a resumed epoch finishes with its own)."""


_OPEN: weakref.WeakSet[Any] = weakref.WeakSet()  # loaders whose workers may still run


def opened(loader: StreamedLoader) -> None:
    """Register a loader for `close_all`."""
    _OPEN.add(loader)


def close_all() -> None:
    """Stop the workers of every streamed loader still alive (the end of a run, whatever the way: an exception's
    traceback can keep them referenced until the garbage collector takes them, too late for a clean shutdown)."""
    for loader in list(_OPEN):
        loader.close()
