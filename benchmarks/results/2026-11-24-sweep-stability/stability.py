"""Issue 20's stability check: the same sweep run N times in a row; how often each rule gives the same answer.

`python stability.py N OUT [sweep overrides...]`: runs `python train.py -m <overrides>` N times with
hydra.sweep.dir=OUT/<i>, then prints, per run, every job's median window rate with its 95% interval, the new
rule's recommendation (sweep_rank: fastest only when separated, else the cheapest of the tie) and the old rule's
"fastest" (the highest images_per_sec), and how often each rule gave its most common answer.
"""

import collections
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT / "src"))

from imgtrain.sweep_rank import rank  # noqa: E402
from imgtrain.sweep_report import collect  # noqa: E402

runs, out, overrides = int(sys.argv[1]), Path(sys.argv[2]), sys.argv[3:]
new_answers, old_answers = [], []
for i in range(runs):
    sweep = out / str(i)
    cmd = [sys.executable, str(ROOT / "train.py"), "-m", *overrides, f"hydra.sweep.dir={sweep}"]
    subprocess.run(cmd, cwd=ROOT, env=os.environ, capture_output=True, text=True, check=True)
    rows, swept = collect(sweep)
    best = rank(rows)
    key = next(k for k in swept if k != "repeat")
    new = "none" if best is None else f"{key}={best['overrides'][key]} ({best['standing']})"
    fastest = max((r for r in rows if r["status"] == "ok" and r["images_per_sec"]), key=lambda r: r["images_per_sec"])
    old = f"{key}={fastest['overrides'][key]}"
    new_answers.append(new.split(" (")[0])
    old_answers.append(old)
    figures = "; ".join(
        f"{r['overrides'][key]}: {r['rate_median']:.1f} [{r['interval_low']:.1f}, {r['interval_high']:.1f}] "
        f"overall {r['images_per_sec']:.1f}"
        for r in rows
        if r["rate_median"] and r["interval_low"]
    )
    print(f"run {i}: {figures} | new rule: {new} | old rule: {old}", flush=True)
for name, answers in (("new rule (recommendation)", new_answers), ("old rule (highest images/s)", old_answers)):
    answer, count = collections.Counter(answers).most_common(1)[0]
    print(f"{name}: {answer} in {count} of {len(answers)} runs; all answers: {answers}")
