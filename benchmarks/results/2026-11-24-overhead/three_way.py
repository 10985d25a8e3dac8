"""Before/after for issue 19's overhead work, in one invocation: the bare loop, train.py as committed, and
train.py with the monitor's PSS cadence put back to 5 s (the only change measured here), interleaved, each
round in a rotated order. Run from the repository root:

    python benchmarks/results/2026-11-24-overhead/three_way.py --rounds 7 --steps 200 --data-dir /tmp/bench-data

Writes one JSON line per run, then the medians and the per-round ratios against the bare loop."""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

# train.py with PSS every 5 s: the same process, the module constant set before Hydra starts.
BEFORE = "import runpy, sys; import imgtrain.metrics.memory as m; m.PSS_INTERVAL_S = 5.0; sys.argv[0] = 'train.py'; "
BEFORE += "runpy.run_path('train.py', run_name='__main__')"


def one(kind: str, steps: int, data_dir: str, run_dir: Path) -> float:
    env = {**os.environ, "IMGTRAIN_DATA_DIR": data_dir, "PYTHONUNBUFFERED": "1"}
    if kind == "bare":
        cmd = [sys.executable, "benchmarks/bare_loop.py", f"--data-dir={data_dir}", f"--steps={steps}", "--warmup=10"]
        out = subprocess.run(cmd, capture_output=True, text=True, env=env, check=True).stdout
        return json.loads(out.strip().splitlines()[-1])["images_per_sec"]
    args = [f"trainer.max_steps={steps}", "trainer.warmup_steps=10", "trainer.save_checkpoints=false"]
    args += ["trainer.progress_bar=false", f"hydra.run.dir={run_dir}"]
    entry = ["train.py"] if kind == "after" else ["-c", BEFORE]
    subprocess.run([sys.executable, *entry, *args], capture_output=True, text=True, env=env, check=True)
    return json.loads((run_dir / "metrics.json").read_text())["images_per_sec"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--data-dir", required=True)
    args = parser.parse_args()
    kinds = ["bare", "after", "before"]
    runs: dict[str, list[float]] = {kind: [] for kind in kinds}
    scratch = Path(tempfile.mkdtemp(prefix="imgtrain-three-way-"))
    for r in range(args.rounds):
        order = kinds[r % 3 :] + kinds[: r % 3]  # each kind leads in turn: drift hits all three
        for kind in order:
            rate = one(kind, args.steps, args.data_dir, scratch / f"{kind}-{r}")
            runs[kind].append(rate)
            print(json.dumps({"round": r, "kind": kind, "images_per_sec": rate}), flush=True)
    summary = {kind: statistics.median(rates) for kind, rates in runs.items()}
    for kind in ("before", "after"):
        pairs = [1 - ours / bare for ours, bare in zip(runs[kind], runs["bare"], strict=True)]
        summary[f"{kind}_overhead_per_round"] = pairs
        summary[f"{kind}_overhead_median"] = statistics.median(pairs)
    gains = [after / before - 1 for after, before in zip(runs["after"], runs["before"], strict=True)]
    summary["after_vs_before_per_round"] = gains
    summary["after_vs_before_median"] = statistics.median(gains)
    print(json.dumps({"summary": summary, "runs": runs}), flush=True)


if __name__ == "__main__":
    main()
