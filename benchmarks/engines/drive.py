"""Interleaved rounds of every engine in one invocation (the order rotated each round), then medians, spreads and
the per-round ratio to the folder. Each engine runs in its own virtual environment (they conflict: MosaicML
pins numpy < 2.2):  python drive.py ROUNDS WORKERS  with ENGINES_PY_<ENGINE>=<python of that venv>."""

import json
import os
import statistics
import subprocess
import sys

ENGINES = ("folder", "litdata", "mosaic", "webdataset")
HERE = os.path.dirname(os.path.abspath(__file__))


def main(rounds: int, counts: list[int]) -> None:
    python = {e: os.environ.get(f"ENGINES_PY_{e.upper()}", sys.executable) for e in ENGINES}
    rates: dict[tuple[str, int], list[float]] = {(e, w): [] for e in ENGINES for w in counts}
    for r in range(rounds):
        order = ENGINES[r % len(ENGINES) :] + ENGINES[: r % len(ENGINES)]
        for workers in counts:
            for engine in order:
                cmd = [python[engine], os.path.join(HERE, "measure.py"), engine, str(workers)]
                out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout.splitlines()[-1]
                rates[(engine, workers)].append(json.loads(out)["images_per_sec"])
                print(r, engine, workers, round(rates[(engine, workers)][-1], 1), flush=True)
    for (engine, workers), values in rates.items():
        folder = rates[("folder", workers)]
        ratios = [v / f for v, f in zip(values, folder, strict=True)]
        print(
            f"{engine:11s} workers={workers} median {statistics.median(values):8.1f} images/s "
            f"(min {min(values):.1f}, max {max(values):.1f}); x folder per round: median "
            f"{statistics.median(ratios):.2f} ({min(ratios):.2f}-{max(ratios):.2f})"
        )


if __name__ == "__main__":
    main(int(sys.argv[1]), [int(w) for w in sys.argv[2].split(",")])
