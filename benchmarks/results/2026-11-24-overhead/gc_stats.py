"""Garbage-collection time of a script's run, printed at exit: `python gc_stats.py <script> [its arguments]`
(BENCHMARKS.md 2026-11-24, overhead; results.md has the commands)."""

import atexit
import gc
import runpy
import sys
import time

stats = {0: [0, 0.0], 1: [0, 0.0], 2: [0, 0.0]}
t0 = {}


def cb(phase, info):
    if phase == "start":
        t0["t"] = time.perf_counter()
    else:
        s = stats[info["generation"]]
        s[0] += 1
        s[1] += time.perf_counter() - t0["t"]


gc.callbacks.append(cb)
atexit.register(
    lambda: print(
        "GCSTATS",
        {g: (n, round(t, 3)) for g, (n, t) in stats.items()},
        "objects",
        len(gc.get_objects()),
        file=sys.stderr,
    )
)
script = sys.argv.pop(1)  # train.py or benchmarks/bare_loop.py; the rest of argv is its arguments
sys.argv[0] = script
runpy.run_path(script, run_name="__main__")
