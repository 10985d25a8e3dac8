"""The fuzz targets of tests/test_fuzz_*.py under Atheris, coverage-guided (libFuzzer): `python tests/atheris_targets.py
TARGET [libFuzzer flags] CORPUS_DIR`, TARGET one of TARGETS. Each input is one file's bytes; the properties are the
Hypothesis targets' own (they are called here), so a property that fails, or an exception a reader does not document,
is a crash libFuzzer saves under -artifact_prefix. tests/test_fuzz_atheris.py runs each on the seeds for a while (make
test-slow). Atheris' comparison-guided mutations reach fields that byte edits at random places rarely do: within a
few hundred inputs it found a zip entry asking for "zip file version 25.3", which zipfile refuses with
NotImplementedError (fuzz_seeds/checkpoint/zip_version_25_3.pt).

libFuzzer's own -timeout must stay 0: it uses SIGALRM, as the targets' own bound on one input (fuzzing.bounded) does.
"""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

import atheris

sys.path.insert(0, str(Path(__file__).resolve().parent))

with atheris.instrument_imports(include=["imgtrain", "hydra_plugins"]):
    import hydra_plugins.imgtrain_optuna.space  # noqa: F401 - instrumented before the targets import it
    import imgtrain.data.csv_rows  # noqa: F401
    import imgtrain.data.shards.manifest  # noqa: F401
    import imgtrain.resilience.checkpoint.files  # noqa: F401
    import imgtrain.sweep.jobs  # noqa: F401

import test_fuzz_checkpoint as checkpoint  # noqa: E402
import test_fuzz_csv as csv_rows  # noqa: E402
import test_fuzz_manifest as manifest  # noqa: E402
import test_fuzz_search_space as space  # noqa: E402
import test_fuzz_sweep as sweep  # noqa: E402

# where the targets write each input as a file: the test's own folder (IMGTRAIN_FUZZ_DIR), else a temporary one
FOLDER = Path(os.environ.get("IMGTRAIN_FUZZ_DIR") or tempfile.mkdtemp(prefix="atheris-"))


def _job(**files: bytes) -> dict:
    return {"metrics": sweep.SEEDS["metrics_1.json"], "overrides": sweep.SEEDS["overrides_1.yaml"], **files}


TARGETS = {  # name -> (the target of one input's bytes, the seeds it starts from)
    "csv": (lambda data: csv_rows.damaged_target(FOLDER, data, ".csv"), csv_rows.SEEDS.values()),
    "manifest": (
        lambda data: manifest.stored_manifest_target(FOLDER / "dst", data),
        [*manifest.MANIFESTS, *manifest.FOUND.values()],
    ),
    "partial": (manifest.partial_target, [manifest.SEEDS["partial.json"]]),
    "index": (lambda data: manifest.index_target(FOLDER, "train", data), manifest.INDEXES),
    "checkpoint": (lambda data: checkpoint.load_target(FOLDER, data), checkpoint.SEEDS.values()),
    "space": (lambda data: space.space_target(data.decode("utf-8", "ignore").replace("\n", " ")), space.LINE_BYTES),
    "job_metrics": (lambda data: sweep.report_target(FOLDER, _job(metrics=data)), [sweep.SEEDS["metrics.json"]]),
    "job_overrides": (lambda data: sweep.report_target(FOLDER, _job(overrides=data)), sweep.OVERRIDES),
}


def write_corpus(target: str, folder: Path) -> None:
    """The target's seeds as libFuzzer's starting corpus, a file each."""
    for number, seed in enumerate(TARGETS[target][1]):
        (folder / f"seed-{number}").write_bytes(seed)


if __name__ == "__main__":
    name = sys.argv.pop(1)
    if len(sys.argv) > 1 and sys.argv[1] == "--write-corpus":
        write_corpus(name, Path(sys.argv[2]))
        sys.exit(0)
    atheris.Setup(sys.argv, TARGETS[name][0])
    atheris.Fuzz()
