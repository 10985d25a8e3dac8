"""One route from the config to a loader, and each loader built once: a run's DataLoader constructions counted
in-process (compose + run), by split, for the default route, device-resident data and `data.num_workers=tune`
(whose probe builds its own loaders, then the training loader once, with the count it chose)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers import FAST, compose_cfg
from torch.utils.data import DataLoader

from imgtrain.data import feed, pipeline
from imgtrain.train import run as run_module
from imgtrain.train import tune


def _count_loaders(monkeypatch: pytest.MonkeyPatch) -> tuple[list[tuple[str, int]], list[int]]:
    """Every DataLoader the run constructs, as (what it reads, num_workers); and one entry per tune probe."""
    built: list[tuple[str, int]] = []

    def counted(route: str | None) -> type[DataLoader]:
        class Counted(DataLoader):
            def __init__(self, samples, *args, **kwargs) -> None:
                split = route or ("train" if samples.replace else "val")  # training replaces unreadable samples
                built.append((split, kwargs.get("num_workers", 0)))
                super().__init__(samples, *args, **kwargs)

        return Counted

    probes: list[int] = []
    loader_rate = tune.loader_rate

    def counted_rate(dataset, plan, *args, **kwargs) -> float:
        probes.append(plan.kwargs["num_workers"])
        return loader_rate(dataset, plan, *args, **kwargs)

    monkeypatch.setattr(pipeline, "DataLoader", counted(None))  # build_loader's: every split's, and the probe's
    monkeypatch.setattr(feed, "DataLoader", counted("resident"))  # build_resident's one pass onto the device
    monkeypatch.setattr(tune, "loader_rate", counted_rate)
    return built, probes


@pytest.mark.slow  # slow: the fast suite's budget (make test <= 120 s on 2 cores); CI runs it in make test-slow
def test_a_default_run_builds_each_loader_once(tmp_path: Path, data_dir: Path, monkeypatch) -> None:
    built, probes = _count_loaders(monkeypatch)
    run_module.run(compose_cfg(*FAST, output_dir=str(tmp_path)))
    assert built == [("train", 1), ("val", 1)] and not probes


@pytest.mark.slow  # slow: the fast suite's budget (make test <= 120 s on 2 cores); CI runs it in make test-slow
def test_device_resident_data_builds_no_training_dataloader(tmp_path: Path, data_dir: Path, monkeypatch) -> None:
    """The training set is decoded once (one DataLoader pass), then batched on the device: no training DataLoader."""
    built, _ = _count_loaders(monkeypatch)
    run_module.run(compose_cfg(*FAST, "data.device_resident=true", output_dir=str(tmp_path)))
    assert sorted(built) == [("resident", 1), ("val", 1)]


@pytest.mark.slow  # a round of tune probes (about 0.5 s each) before a fast run
def test_a_tuned_run_builds_its_training_loader_once_with_the_chosen_count(
    tmp_path: Path, data_dir: Path, monkeypatch
) -> None:
    built, probes = _count_loaders(monkeypatch)
    run_module.run(compose_cfg(*FAST, "data.num_workers=tune", "data.tune_budget_s=2", output_dir=str(tmp_path)))
    tuned = json.loads((tmp_path / "loader_args.json").read_text())["tune"]
    assert len(probes) == tuned["rounds"] * len(tuned["table"]) > 0
    assert built[0] == ("val", 1)  # planned and built before the probe; the training loader waits for its count
    assert built[1:-1] == [("train", workers) for workers in probes]  # the probes' own loaders, one each
    assert built[-1] == ("train", tuned["chosen"])  # then the training loader, once, with the count chosen
