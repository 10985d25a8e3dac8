"""train.py and the bare loop, each with torch's default AdamW on CPU (single-tensor: temporaries per parameter)
and with fused=True forced (one kernel, no temporaries), interleaved in one invocation, the order rotating.
Run from the repository root:

    python benchmarks/results/2026-11-24-overhead/fused_four_way.py --rounds 5 --steps 200 --data-dir /tmp/bench-data
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

# Run `script` with every torch.optim.AdamW built fused (unless `fused` is False).
WRAPPER = """import runpy, sys, torch
if sys.argv.pop(1) == "fused":
    built = torch.optim.AdamW.__init__
    def fused_init(self, *args, **kwargs):
        kwargs.setdefault("fused", True)
        built(self, *args, **kwargs)
    torch.optim.AdamW.__init__ = fused_init
script = sys.argv[1]
sys.argv = sys.argv[1:]
runpy.run_path(script, run_name="__main__")
"""


def one(kind: str, steps: int, data_dir: str, run_dir: Path) -> float:
    loop, optimizer = kind.split("-")
    env = {**os.environ, "IMGTRAIN_DATA_DIR": data_dir, "PYTHONUNBUFFERED": "1"}
    cmd = [sys.executable, "-c", WRAPPER, optimizer]
    if loop == "bare":
        cmd += ["benchmarks/bare_loop.py", f"--data-dir={data_dir}", f"--steps={steps}", "--warmup=10"]
        out = subprocess.run(cmd, capture_output=True, text=True, env=env, check=True).stdout
        return json.loads(out.strip().splitlines()[-1])["images_per_sec"]
    cmd += ["train.py", f"trainer.max_steps={steps}", "trainer.warmup_steps=10", "trainer.save_checkpoints=false"]
    cmd += ["trainer.progress_bar=false", f"hydra.run.dir={run_dir}"]
    subprocess.run(cmd, capture_output=True, text=True, env=env, check=True)
    return json.loads((run_dir / "metrics.json").read_text())["images_per_sec"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--data-dir", required=True)
    args = parser.parse_args()
    kinds = ["bare-default", "train-default", "bare-fused", "train-fused"]
    runs: dict[str, list[float]] = {kind: [] for kind in kinds}
    scratch = Path(tempfile.mkdtemp(prefix="imgtrain-fused-"))
    for r in range(args.rounds):
        for kind in kinds[r % 4 :] + kinds[: r % 4]:
            rate = one(kind, args.steps, args.data_dir, scratch / f"{kind}-{r}")
            runs[kind].append(rate)
            print(json.dumps({"round": r, "kind": kind, "images_per_sec": rate}), flush=True)
    summary: dict[str, object] = {kind: statistics.median(rates) for kind, rates in runs.items()}
    for optimizer in ("default", "fused"):
        pairs = [1 - t / b for t, b in zip(runs[f"train-{optimizer}"], runs[f"bare-{optimizer}"], strict=True)]
        summary[f"overhead_{optimizer}_per_round"] = pairs
        summary[f"overhead_{optimizer}_median"] = statistics.median(pairs)
    print(json.dumps({"summary": summary, "runs": runs}), flush=True)


if __name__ == "__main__":
    main()
