"""The epoch-start stall (issue 20, part 5): timed per epoch from its start to its first batch and window."""

from __future__ import annotations

import time

from imgtrain.metrics import console, report
from imgtrain.metrics.epoch_start import EpochStarts
from imgtrain.metrics.windows import Window


def test_each_epoch_start_is_timed_and_its_cost_is_the_first_window_beyond_the_steady_steps() -> None:
    starts = EpochStarts()
    for epoch, stall in enumerate((0.05, 0.03)):
        starts.begin()
        time.sleep(stall)
        first = starts.batch_arrived()
        assert first is not None and first >= stall and starts.batch_arrived() is None  # only the first batch
        # the epoch's first window: 4 steps at a steady 0.1 s plus the stall (and 0.2 s more after epoch 0)
        assert starts.window_closed(Window(4, 128, 0.4 + stall + 0.2 * epoch, 0.0))
        assert not starts.window_closed(Window(4, 128, 0.4, 0.0))  # a later window of the same epoch
    figures = starts.summary(step_s=0.1, steps_per_epoch=20)
    assert len(figures["epoch_first_batch_s"]) == 2
    assert figures["epoch_start_cost_s"] == [0.23]  # the second epoch only: the first is the run's start-up
    assert figures["epoch_start_cost_frac"] == 0.23 / (20 * 0.1)


def test_the_verdict_names_a_costly_epoch_start_and_the_remedy() -> None:
    summary = {
        "mode": "train",
        "data_wait_frac": 0.01,
        "pipeline": {},
        "epoch_start_cost_s": [0.5, 0.6, 0.7],
        "epoch_start_cost_frac": 0.12,
        "loader": {"num_workers": 4, "persistent_workers": False},
    }
    line = report.verdict(summary)
    assert line.startswith("compute-bound") and "; each epoch start costs 0.60 s (12% of an epoch)" in line
    assert "data.persistent_workers=true" in line
    quiet = {**summary, "epoch_start_cost_frac": 0.01}
    assert "epoch start" not in report.verdict(quiet)
    persistent = {**summary, "loader": {"num_workers": 4, "persistent_workers": True}}
    assert "persistent_workers" not in report.verdict(persistent)
    assert console.epoch_start_line({"epoch_first_batch_s": [0.2], "epoch_start_cost_s": []}).endswith(
        "one epoch: no later epoch start to measure"
    )


def test_the_rate_line_gives_the_median_window_beside_its_interval_and_the_overall_rate() -> None:
    """Epoch-start stalls pull the overall rate below the median window's interval (2026-11-27's gpu-check: 2,465
    img/s overall, the median window's interval 2,580-2,877): the line names both, each with what it is."""
    summary = {
        "images_per_sec": 4930.0,  # two ranks
        "images_per_sec_per_process": 2465.0,
        "images_per_sec_median": 2720.0,
        "images_per_sec_interval": [5160.0, 5754.0],  # scaled to both ranks, as the summary writes it
        "images_per_sec_windows": [2700.0] * 10,
    }
    assert console.rate_line(summary) == (
        "4,930.0 over all steady steps; median window 5,440.0 (95% interval of the median window 5,160.0-5,754.0, "
        "10 windows)"
    )
