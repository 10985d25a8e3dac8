"""Times of StepMeter.start_window, EpochBatches.__enter__, next_batch (over 1 ms) and evaluate in a train.py run."""

import atexit
import runpy
import sys
import time

sys.path.insert(0, "src")
import imgtrain.loop as loop
from imgtrain.metrics.windows import StepMeter

T = []


def wrap(obj, name, label):
    orig = getattr(obj, name)

    def f(*a, **k):
        t = time.perf_counter()
        r = orig(*a, **k)
        T.append(f"{label}: {1000 * (time.perf_counter() - t):.0f} ms at {t:.2f}")
        return r

    setattr(obj, name, f)


wrap(StepMeter, "start_window", "start_window")
wrap(loop.EpochBatches, "__enter__", "EpochBatches.enter")
wrap(loop, "next_batch", "next_batch")
wrap(loop, "evaluate", "evaluate")
atexit.register(
    lambda: print(
        "\n".join(x for x in T if not x.startswith("next_batch: 0 ") and not x.startswith("next_batch: 1 ")),
        file=sys.stderr,
    )
)
script = sys.argv.pop(1)
sys.argv[0] = script
runpy.run_path(script, run_name="__main__")
