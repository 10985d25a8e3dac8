"""Per-step wall time and minor page faults of steps 70-90 of a training script (AdamW steps counted)."""

import atexit
import resource
import runpy
import sys
import time

import torch

state = {"n": 0, "t": None, "f": 0}
orig = torch.optim.AdamW.step
out_lines = []


def step(self, *a, **k):
    r = orig(self, *a, **k)
    state["n"] += 1
    now = time.perf_counter()
    f = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    if state["t"] is not None and 70 <= state["n"] <= 90:
        out_lines.append(f"step {state['n']}: {1000 * (now - state['t']):.0f} ms, {f - state['f']} faults")
    state["t"], state["f"] = now, f
    return r


torch.optim.AdamW.step = step
atexit.register(lambda: print("\n".join(out_lines), file=sys.stderr))
script = sys.argv.pop(1)
sys.argv[0] = script
runpy.run_path(script, run_name="__main__")
