"""The host-bound verdict: a GPU run that waits for no data while its GPU idles and its training thread runs nearly
all the time is bound by its kernel launches, and is told what cuts them, with the figures that show it."""

from __future__ import annotations

import pytest
from test_pipeline import _summary

from imgtrain.metrics import report

DECODE = {"read": 0.1, "decode": 3.0, "augment": 0.5}


def _launch_bound(**extra) -> dict:
    """The H200's ResNet-18 DataLoader row (2026-11-27): 15 workers keeping 3.7 cores busy, the GPU 43% busy."""
    summary = _summary(0.02, DECODE, busy=3.7 / 15, gpu_util_mean=43.0, main_thread_busy_frac=0.97, compile_mode=None)
    summary["loader"]["num_workers"] = 15
    summary["pipeline"] |= {"workers": 15, "worker_busy_cores": 3.7}
    return summary | extra


def test_a_launch_bound_gpu_run_is_called_host_bound_with_its_figures() -> None:
    verdict = report.verdict(_launch_bound())
    assert verdict.startswith(
        "host-bound: only 2% of step time waits for data and the GPU is busy 43% of the time (NVML), while the "
        "training thread runs 97% of it"
    ), verdict
    assert "system.compile=true system.compile_mode=reduce_overhead" in verdict
    assert "data.num_workers=5 (the 15 workers kept 3.7 cores busy" in verdict  # ceil(3.7 x 1.25)


@pytest.mark.parametrize(
    ("compile_mode", "remedy"),
    [
        ("default", "try system.compile_mode=reduce_overhead (CUDA graphs"),
        ("max_autotune_no_cudagraphs", "try system.compile_mode=reduce_overhead (CUDA graphs"),
        ("reduce_overhead", "try a larger data.batch_size"),
    ],
)
def test_the_remedy_follows_what_the_run_already_compiles(compile_mode: str, remedy: str) -> None:
    assert remedy in report.verdict(_launch_bound(compile_mode=compile_mode))


@pytest.mark.parametrize(
    "changes",
    [
        {"gpu_util_mean": 97.0},  # the GPU is busy: compute-bound
        {"main_thread_busy_frac": 0.4},  # the thread waits (on the GPU's queue): not launches
        {"gpu_util_mean": None},  # a CPU run, or no NVML: nothing to tell
        {"main_thread_busy_frac": None},  # an older metrics.json
    ],
)
def test_a_busy_gpu_or_an_idle_thread_is_not_host_bound(changes: dict) -> None:
    assert report.verdict(_launch_bound(**changes)).startswith("compute-bound")


def test_workers_that_need_their_cores_are_not_told_to_go() -> None:
    summary = _launch_bound()
    summary["pipeline"]["worker_busy_cores"] = 13.0
    verdict = report.verdict(summary)
    assert verdict.startswith("host-bound") and "data.num_workers" not in verdict


def test_an_input_bound_run_stays_input_bound() -> None:
    assert report.verdict(_launch_bound(data_wait_frac=0.4)).startswith("input-bound")
