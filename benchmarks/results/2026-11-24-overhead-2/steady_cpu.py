"""Run a training script; between AdamW steps A and B, report wall time and CPU seconds per thread and per child."""

import os
import resource
import runpy
import sys
import time

import psutil
import torch

A, B = int(os.environ.get("STEADY_A", 20)), int(os.environ.get("STEADY_B", 280))
tck = os.sysconf("SC_CLK_TCK")


def snap():
    threads = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/stat") as stat:
                raw = stat.read()
            f = raw[raw.rindex(")") + 2 :].split()
            threads[int(tid) - os.getpid()] = (int(f[11]) + int(f[12])) / tck
        except OSError:
            pass
    kids = {}
    for c in psutil.Process().children(recursive=True):
        try:
            t = c.cpu_times()
            kids[c.pid] = t.user + t.system
        except psutil.Error:
            pass
    return time.perf_counter(), threads, kids, resource.getrusage(resource.RUSAGE_SELF).ru_minflt


state = {"n": 0}
orig = torch.optim.AdamW.step


def step(self, *a, **k):
    out = orig(self, *a, **k)
    state["n"] += 1
    if state["n"] == A:
        state["a"] = snap()
    elif state["n"] == B:
        (t0, th0, k0, f0), (t1, th1, k1, f1) = state["a"], snap()
        steps = B - A
        rows = {f"thread+{t}": th1[t] - th0.get(t, 0.0) for t in th1}
        rows |= {f"child {p}": k1[p] - k0.get(p, 0.0) for p in k1}
        shown = {k: round(v / steps * 1000, 2) for k, v in sorted(rows.items(), key=lambda kv: -kv[1]) if v > 0.005}
        import threading

        names = {t.native_id - os.getpid(): t.name for t in threading.enumerate()}
        kids = {c.pid: " ".join(c.cmdline())[-80:] for c in psutil.Process().children(recursive=True)}
        print("NAMES", names, kids, file=sys.stderr)
        print(
            "STEADY wall_ms/step",
            round((t1 - t0) / steps * 1000, 2),
            "cpu_ms/step",
            shown,
            "minflt/step",
            round((f1 - f0) / steps),
            file=sys.stderr,
            flush=True,
        )
    return out


torch.optim.AdamW.step = step
script = sys.argv.pop(1)
sys.argv[0] = script
runpy.run_path(script, run_name="__main__")
