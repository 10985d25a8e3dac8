"""A wrapper used for BENCHMARKS.md 2026-11-24 (overhead): see results.md in this folder for the command."""

import atexit
import resource
import runpy
import sys

import torch

rec = {}
count = [0]
real = torch.optim.AdamW.step


def step(self, *a, **k):
    count[0] += 1
    if count[0] in (10, 200):
        rec[count[0]] = (
            resource.getrusage(resource.RUSAGE_SELF).ru_minflt,
            resource.getrusage(resource.RUSAGE_SELF).ru_stime,
        )
    return real(self, *a, **k)


torch.optim.AdamW.step = step
atexit.register(
    lambda: print(
        "FAULTS 10..200", rec[200][0] - rec[10][0], "stime", round(rec[200][1] - rec[10][1], 2), file=sys.stderr
    )
)
sys.argv[0] = "benchmarks/bare_loop.py"
runpy.run_path("benchmarks/bare_loop.py", run_name="__main__")
