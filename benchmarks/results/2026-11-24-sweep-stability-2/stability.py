"""Issue 20's stability check, second round: the same sweep run N times in a row; how often each rule gives the
same answer. The rules are applied to the saved sweep directories, so one set of sweeps serves every rule.

`python stability.py run N OUT [sweep overrides...]`: runs `python train.py -m <overrides>` N times with
hydra.sweep.dir=OUT/<i>, then reports as below.
`python stability.py report OUT [OUT...]`: for each OUT/<i>, every setting's median window rate with its 95%
interval, and the answer of three rules: the report's (sweep_rank.rank: fastest only when separated by its
interval and by the sweep's resolution, else the cheapest of the tie), intervals alone (resolution 0, the rule
of the first stability run) and the highest images/s (the rule before issue 20); then how often each rule gave
its most common answer.
"""

import collections
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT / "src"))

import imgtrain.sweep_rank as sweep_rank  # noqa: E402
from imgtrain.sweep_rank import rank  # noqa: E402
from imgtrain.sweep_report import collect  # noqa: E402

KEY = "data.num_workers"


def answers(sweep: Path) -> tuple[str, str, str, str]:
    rows, _ = collect(sweep)
    report = rank(rows)
    line = f"{report['overrides'][KEY]} ({report['standing']}; resolution {report['resolution'].split(',')[0]})"
    figures = "; ".join(
        f"{r['overrides'][KEY]}: {r['rate_median']:.1f} [{r['interval_low']:.1f}, {r['interval_high']:.1f}]"
        for r in {r["overrides"][KEY]: r for r in rows}.values()
        if r["rate_median"] and r["interval_low"]
    )
    rows, _ = collect(sweep)
    intervals = _intervals_only(rows)
    fastest = max((r for r in rows if r["status"] == "ok" and r["images_per_sec"]), key=lambda r: r["images_per_sec"])
    return figures, line, str(intervals["overrides"][KEY]), str(fastest["overrides"][KEY])


def _intervals_only(rows: list[dict]) -> dict:
    """The rule of the first stability run: separated intervals suffice (no resolution, measured or assumed)."""
    measured = sweep_rank.resolution
    sweep_rank.resolution = lambda repeats, min_gain: (0.0, "none")
    try:
        return rank(rows, min_gain=0.0)
    finally:
        sweep_rank.resolution = measured


def report(sweeps: list[Path]) -> None:
    rules = {"report's rule": [], "intervals alone": [], "highest images/s": []}
    for sweep in sweeps:
        figures, new, intervals, old = answers(sweep)
        print(f"{sweep}: {figures} | report: {new} | intervals alone: {intervals} | highest: {old}", flush=True)
        for name, answer in zip(rules, (new.split(" (")[0], intervals, old), strict=True):
            rules[name].append(answer)
    for name, given in rules.items():
        answer, count = collections.Counter(given).most_common(1)[0]
        print(f"{name}: {KEY}={answer} in {count} of {len(given)} runs; all answers: {given}")


if sys.argv[1] == "run":
    runs, out, overrides = int(sys.argv[2]), Path(sys.argv[3]), sys.argv[4:]
    for i in range(runs):
        cmd = [sys.executable, str(ROOT / "train.py"), "-m", *overrides, f"hydra.sweep.dir={out / str(i)}"]
        subprocess.run(cmd, cwd=ROOT, env=os.environ, capture_output=True, text=True, check=True)
    report([out / str(i) for i in range(runs)])
else:
    report([Path(arg) for arg in sys.argv[2:]])
