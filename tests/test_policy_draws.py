"""dataset.augment's policies drawn from each sample's own uniforms (data/policy_draws.py): torchvision's algorithm
draw for draw, independent of torch's generator, and the same on any thread."""

from __future__ import annotations

import contextlib
import threading
from collections import Counter
from collections.abc import Iterator

import numpy as np
import pytest
import torch
from torchvision.transforms import v2

from imgtrain.data import policies
from imgtrain.data.policy_draws import apply_drawn, draws_of

SEEDS = np.arange(60, dtype=np.int64) * 104729 + 7


@pytest.fixture(scope="module")
def images() -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return [torch.randint(0, 256, (3, 24, 24), dtype=torch.uint8, generator=generator) for _ in SEEDS]


def _fed(monkeypatch: pytest.MonkeyPatch, draws: Iterator[float]) -> None:
    """torch.randint(n, ()) and torch.rand(()) as the next uniform gives them, in the order torchvision asks."""
    monkeypatch.setattr(torch, "randint", lambda n, size: torch.tensor(min(int(next(draws) * n), n - 1)))
    monkeypatch.setattr(torch, "rand", lambda size: torch.tensor(next(draws), dtype=torch.float64))


@pytest.mark.parametrize(
    "policy", [v2.TrivialAugmentWide(), v2.RandAugment(num_ops=1, magnitude=9)], ids=["trivialaugment", "randaugment"]
)
def test_the_draws_are_torchvisions_own_read_from_the_uniforms(images, policy, monkeypatch) -> None:
    """These two policies ask for their draws in a fixed order (operation, then bin, then sign), so torch's draws
    fed with a sample's uniforms in that order make torchvision's forward give the very same image."""
    rows = policies.uniforms(SEEDS, draws_of(policy), policies.POLICY_FIRST)
    ours = [apply_drawn(policy, image, row) for image, row in zip(images, rows, strict=True)]
    for image, row, mine in zip(images, rows, ours, strict=True):
        with monkeypatch.context() as patch:
            _fed(patch, iter(row))
            assert torch.equal(policy(image), mine)
    assert sum(not torch.equal(a, b) for a, b in zip(images, ours, strict=True)) > len(images) // 2  # not a no-op


def test_autoaugment_chooses_its_sub_policies_evenly_and_applies_each_operation_at_its_probability() -> None:
    policy = v2.AutoAugment(v2.AutoAugmentPolicy.IMAGENET)
    rows = policies.uniforms(np.arange(20000), draws_of(policy), policies.POLICY_FIRST)
    chosen = Counter(min(int(u * len(policy._policies)), len(policy._policies) - 1) for u in rows[:, 0])
    assert len(chosen) == len(policy._policies) and max(chosen.values()) / min(chosen.values()) < 1.5
    first = np.array([policy._policies[min(int(u * 25), 24)][0][1] for u in rows[:, 0]])
    applied = rows[:, 1] <= first
    assert abs(applied.mean() - first.mean()) < 0.02  # each operation at its own probability, on average


@pytest.mark.parametrize(
    "policy",
    [
        [v2.TrivialAugmentWide()],
        [v2.RandAugment(num_ops=2)],
        [v2.AutoAugment()],
        [v2.RandomErasing(1.0, value="random")],
    ],
    ids=["trivialaugment", "randaugment", "autoaugment", "noise-erasing"],
)
def test_the_same_images_whatever_torchs_generator_and_on_any_thread(images, policy) -> None:
    """Four threads at once, while another re-seeds and draws from torch's generator under GENERATOR_LOCK (as
    train/mixing.py does): each gives the images a single thread gives. A transform that draws from torch's
    generator itself (noise erasing) runs under the lock; the policies touch no generator."""
    serial = policies.apply_policy(images, SEEDS, policy)
    torch.manual_seed(123)
    assert all(torch.equal(a, b) for a, b in zip(serial, policies.apply_policy(images, SEEDS, policy), strict=True))
    results: list[list[torch.Tensor]] = [[] for _ in range(4)]
    stop = threading.Event()

    def noise() -> None:
        lock = policies.GENERATOR_LOCK if draws_of(policy[0]) is None else contextlib.nullcontext()
        while not stop.is_set():
            with lock:  # the policies touch no generator: no lock needed beside them
                torch.manual_seed(int(torch.randint(1 << 30, ())))

    def draw(slot: int) -> None:
        results[slot] = policies.apply_policy(images, SEEDS, policy)

    meddler = threading.Thread(target=noise)
    meddler.start()
    threads = [threading.Thread(target=draw, args=(slot,)) for slot in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    stop.set()
    meddler.join()
    for result in results:
        assert all(torch.equal(a, b) for a, b in zip(serial, result, strict=True))
