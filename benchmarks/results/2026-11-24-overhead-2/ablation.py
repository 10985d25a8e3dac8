"""The ablation runner of benchmarks/results/2026-11-24-overhead/ablation.py with the keys renamed (trainer.* was
split on 2026-11-24): interleaved runs of train.py and the bare loop under different settings.
argv[1]: JSON {name: [interpreter or "bare", extra environment (SCRIPT: a wrapper to run instead of train.py),
[overrides]]}; argv[2]: rounds (the order reverses every other round); argv[3]: steps (default 150)."""

import json
import os
import resource
import statistics
import subprocess
import sys
from pathlib import Path

variants = json.loads(sys.argv[1])
rounds = int(sys.argv[2])
steps = sys.argv[3] if len(sys.argv) > 3 else "150"
res = {k: [] for k in variants}
for r in range(rounds):
    order = list(variants) if r % 2 == 0 else list(reversed(list(variants)))
    for k in order:
        kind, env, extra = variants[k]
        env = dict(env)
        environ = {
            **os.environ,
            "IMGTRAIN_DATA_DIR": "/tmp/bench-before/data",
            **{k: v for k, v in env.items() if k != "SCRIPT"},
        }
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        if kind == "bare":
            p = subprocess.run(
                [
                    ".venv/bin/python",
                    "benchmarks/bare_loop.py",
                    "--data-dir=/tmp/bench-before/data",
                    f"--steps={steps}",
                    "--warmup=10",
                    *extra,
                ],
                capture_output=True,
                text=True,
                env=environ,
            )
            ips = json.loads(p.stdout.strip().splitlines()[-1])["images_per_sec"]
        else:
            d = f"/tmp/ab/{k}-{r}"
            p = subprocess.run(
                [
                    kind,
                    *([env.pop("SCRIPT")] if "SCRIPT" in env else ["train.py"]),
                    f"train.max_steps={steps}",
                    "metrics.skip_first_steps=10",
                    "checkpoint.save=false",
                    "metrics.progress_bar=false",
                    f"hydra.run.dir={d}",
                    *extra,
                ],
                capture_output=True,
                text=True,
                env=environ,
            )
            ips = json.loads(Path(f"{d}/metrics.json").read_text())["images_per_sec"]
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        res[k].append((ips, after.ru_minflt - before.ru_minflt))
        print(k, r, round(ips, 1), after.ru_minflt - before.ru_minflt, flush=True)
for k, v in res.items():
    print(k, "median img/s", round(statistics.median(x for x, _ in v), 1), "runs", [round(x) for x, _ in v])
