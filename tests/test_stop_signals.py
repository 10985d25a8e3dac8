"""Stop signals while a run ends with an exception: under torchrun, once one rank has failed the agent sends
SIGTERM to the others, which may by then have left the training loop and be cleaning up (workers, the lock, the
process group) before printing their own line. The signal must not kill them silently there (exit -15, no line):
it stays recorded until run() returns, and the handlers that were there before come back then."""

from __future__ import annotations

import os
import signal
import time

import pytest

from imgtrain.resilience.faults import StopSignals, restore_after_ending


@pytest.fixture
def delivered() -> list[int]:
    """A handler standing for what was there before the run (Python's default would end the test process)."""
    got: list[int] = []
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: got.append(signum))
    yield got
    signal.signal(signal.SIGTERM, previous)


def _sigterm() -> None:
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(0.05)  # Python runs the handler in the main thread at its next instruction


def test_a_stop_signal_while_a_failed_run_cleans_up_is_recorded_until_run_returns(delivered: list[int]) -> None:
    signals = StopSignals()
    with pytest.raises(RuntimeError), signals:
        raise RuntimeError("Connection closed by peer")
    _sigterm()  # the run is cleaning up: its handler still records
    assert signals.received == signal.SIGTERM and delivered == []
    restore_after_ending()
    _sigterm()  # run() has returned: the handler from before is back
    assert delivered == [signal.SIGTERM]


def test_a_run_that_leaves_training_normally_restores_the_handlers_at_once(delivered: list[int]) -> None:
    with StopSignals() as signals:
        pass
    _sigterm()
    assert delivered == [signal.SIGTERM] and signals.received == 0
