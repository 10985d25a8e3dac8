"""A wrapper used for BENCHMARKS.md 2026-11-24 (overhead): see results.md in this folder for the command."""

import atexit
import resource
import runpy
import sys

import imgtrain.metrics.processor as proc

rec = {}
real = proc.Metrics.step


def step(self, n, *a):
    if n in (10, 200):
        rec[n] = (resource.getrusage(resource.RUSAGE_SELF).ru_minflt, resource.getrusage(resource.RUSAGE_SELF).ru_stime)
    return real(self, n, *a)


proc.Metrics.step = step
atexit.register(
    lambda: print(
        "FAULTS 10..200", rec[200][0] - rec[10][0], "stime", round(rec[200][1] - rec[10][1], 2), file=sys.stderr
    )
)
sys.argv[0] = "train.py"
runpy.run_path("train.py", run_name="__main__")
