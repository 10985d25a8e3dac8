"""A Python that is the GPU box: this interpreter's packages without the optional engines and dev tools it lacks.

The GPU box (DEVELOPERS.md) has torch, torchvision, timm, tensorboard, psutil, matplotlib and nvidia-ml-py, with
hydra-core and omegaconf installed from wheels, and no package index: no LitData, boto3, botocore, obstore,
Optuna, hydra-optuna-sweeper, moto, scikit-learn or SciPy, and a TorchCodec that may not load. `site_without`
builds a folder of links to this interpreter's site-packages, leaving those distributions out (their modules, their
metadata, and their entries in shared namespace packages such as hydra_plugins), and `command` runs Python with
`-S` on it: the packages are absent, as they are there, not hidden by a hook that the code under test could get
around (Hydra's plugin scan lists hydra_plugins from the file system, for one). DataLoader workers started by
spawn or forkserver inherit `-S` and PYTHONPATH.
"""

from __future__ import annotations

import importlib.metadata
import os
import site
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# Distributions the GPU box does not have (s3transfer comes with boto3; scipy with scikit-learn).
ABSENT = (
    "litdata",
    "boto3",
    "botocore",
    "s3transfer",
    "obstore",
    "optuna",
    "hydra-optuna-sweeper",
    "moto",
    "torchcodec",
    "scikit-learn",
    "scipy",
)


def _site_packages() -> Path:
    return Path(next(p for p in site.getsitepackages() if p.endswith("site-packages")))


def _parts(names: tuple[str, ...], absent: bool) -> set[tuple[str, ...]]:
    """The first two path components of the files of the distributions in `names` (absent) or of all others."""
    found: set[tuple[str, ...]] = set()
    for dist in importlib.metadata.distributions():
        name = (dist.metadata["Name"] or "").lower().replace("_", "-")
        if (name in names) != absent:
            continue
        for file in dist.files or ():
            found.add(tuple(Path(file).parts[:2]))
        found.add((Path(dist._path).name,))  # its .dist-info folder  # noqa: SLF001
    return found


def site_without(folder: Path, absent: tuple[str, ...] = ABSENT) -> Path:
    """`folder` filled with links to site-packages' entries, except those of the `absent` distributions."""
    source = _site_packages()
    gone, kept = _parts(absent, True), _parts(absent, False)
    gone_top = {p[0] for p in gone}
    shared = gone_top & {p[0] for p in kept}  # a namespace package both sides install into: hydra_plugins
    folder.mkdir(parents=True, exist_ok=True)
    for entry in source.iterdir():
        name = entry.name
        if name in shared and entry.is_dir():
            (folder / name).mkdir(exist_ok=True)
            for child in entry.iterdir():
                if (name, child.name) not in gone:
                    (folder / name / child.name).symlink_to(child)
        elif name not in gone_top and not name.endswith(".pth") and not name.startswith("__editable__"):
            (folder / name).symlink_to(entry)
    return folder


def command(site_dir: Path, *args: str) -> tuple[list[str], dict[str, str]]:
    """(argv, environment) running `python -S <args>` from the repository with only `site_dir` and src/."""
    env = {key: value for key, value in os.environ.items() if not key.startswith(("PYTHON", "IMGTRAIN_"))}
    env["PYTHONPATH"] = os.pathsep.join([str(site_dir), str(ROOT / "src"), str(ROOT / "tests")])
    env["HYDRA_FULL_ERROR"] = "0"
    return [sys.executable, "-S", *args], env
