"""The epoch-start stall (issue 20, part 5): timed per epoch from its start to its first batch and window."""

from __future__ import annotations

import time

from imgtrain.metrics import report
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
    assert report.epoch_start_line({"epoch_first_batch_s": [0.2], "epoch_start_cost_s": []}).endswith(
        "one epoch: no later epoch start to measure"
    )
