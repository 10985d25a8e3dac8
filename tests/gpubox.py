"""A Python that is the GPU box: this interpreter's packages without the optional engines and dev tools it lacks,
then the device wheels installed the documented way.

The GPU box (docs/gpu.md) has torch, torchvision, timm, tensorboard, psutil, matplotlib and nvidia-ml-py, and no
package index: no LitData, boto3, botocore, obstore, Optuna, moto, scikit-learn, SciPy, Hypothesis, Atheris or
pg8000, and no hydra-core, omegaconf, antlr4-python3-runtime, submitit, hydra-submitit-launcher or TorchCodec until
the wheels of ../shared/device-wheels (beside the checkout, not in it) are installed: `python -m pip install --no-index
--no-deps --target DIR <wheel>`, DIR on PYTHONPATH. `site_without` builds a folder of links to this interpreter's
site-packages, leaving those distributions out (their modules, their metadata, and their entries in shared
namespace packages such as hydra_plugins), and `command` runs Python with `-S` on it: the packages are absent, as
they are there, not hidden by a hook that the code under test could get around (Hydra's plugin scan lists
hydra_plugins from the file system, for one). DataLoader workers started by spawn or forkserver inherit `-S` and
PYTHONPATH.

`make_box` then installs the device wheels into a folder of their own, one pip call per wheel, as the box does: a
wheel that does not install (TorchCodec's is for CPython 3.12; this venv's Python may be another) is reported
and leaves the others installed. Where ../shared/device-wheels does not exist (a CI checkout without it), the
same effect is built from this venv: its hydra-core, omegaconf, antlr4, submitit and hydra-submitit-launcher
files are linked into that folder, and TorchCodec stays absent, as it is where its wheel does not load.
"""

from __future__ import annotations

import importlib.metadata
import os
import site
import subprocess
import sys
from dataclasses import dataclass
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
    "moto",
    "torchcodec",
    "scikit-learn",
    "scipy",
    *("hypothesis", "sortedcontainers", "atheris", "pg8000", "scramp", "asn1crypto"),  # dev tools the box lacks
    *("hydra-core", "omegaconf", "antlr4-python3-runtime", "submitit", "hydra-submitit-launcher"),  # device wheels
)
WHEELS = ROOT.parent / "shared" / "device-wheels"
WHEEL_DISTRIBUTIONS = ("hydra-core", "omegaconf", "antlr4-python3-runtime", "submitit", "hydra-submitit-launcher")


@dataclass(frozen=True)
class Box:
    """The emulated GPU box: site-packages without ABSENT, and the device wheels' own folder."""

    site: Path
    wheels: Path
    installed: dict[str, str]  # each wheel (or, without them, each distribution linked): "installed" or why not

    @property
    def pythonpath(self) -> str:
        return os.pathsep.join([str(self.wheels), str(self.site)])


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


def install_wheels(site_dir: Path, target: Path, wheels: Path = WHEELS) -> dict[str, str]:
    """The device wheels in `target` as docs/gpu.md installs them, one pip call per wheel so that one that does not
    install leaves the others; without `wheels`, this venv's files of the same distributions linked there instead."""
    target.mkdir(parents=True, exist_ok=True)
    if not wheels.is_dir():
        return _link_distributions(target)
    done = {}
    for wheel in sorted(wheels.glob("*.whl")):
        pip = ["-m", "pip", "install", "-q", "--no-index", "--no-deps", "--target", str(target), str(wheel)]
        argv, env = command(site_dir, *pip, pythonpath=str(site_dir))
        result = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=300)
        lines = (result.stderr or result.stdout).strip().splitlines()
        done[wheel.name] = "installed" if result.returncode == 0 else f"not installed: {lines[-1] if lines else ''}"
    return done


def _link_distributions(target: Path) -> dict[str, str]:
    """This venv's files of WHEEL_DISTRIBUTIONS linked into `target` (hydra_plugins: only their own plugins)."""
    source = _site_packages()
    for parts in sorted(_parts(WHEEL_DISTRIBUTIONS, True)):
        if parts[0].startswith("..") or not (source / parts[0]).exists():
            continue  # scripts outside site-packages
        if parts[0] == "hydra_plugins" and len(parts) == 2:  # a namespace package others install into too
            (target / parts[0]).mkdir(exist_ok=True)
            if not (target / parts[0] / parts[1]).exists():
                (target / parts[0] / parts[1]).symlink_to(source / parts[0] / parts[1])
        elif parts[0] != "hydra_plugins" and not (target / parts[0]).exists():
            (target / parts[0]).symlink_to(source / parts[0])
    return {name: "linked from this venv (no ../shared/device-wheels here)" for name in WHEEL_DISTRIBUTIONS}


def make_box(folder: Path) -> Box:
    """The GPU box in `folder`: site-packages without ABSENT, then the device wheels installed."""
    site_dir = site_without(folder / "site-packages")
    wheels = folder / "device-wheels"
    return Box(site_dir, wheels, install_wheels(site_dir, wheels))


def command(box: Box | Path, *args: str, pythonpath: str | None = None) -> tuple[list[str], dict[str, str]]:
    """(argv, environment) running `python -S <args>` from the repository with only the box's packages (or
    `pythonpath`), src/ and tests/."""
    env = {key: value for key, value in os.environ.items() if not key.startswith(("PYTHON", "IMGTRAIN_"))}
    packages = pythonpath or (box.pythonpath if isinstance(box, Box) else str(box))
    env["PYTHONPATH"] = os.pathsep.join([packages, str(ROOT / "src"), str(ROOT / "tests")])
    env["HYDRA_FULL_ERROR"] = "0"
    return [sys.executable, "-S", *args], env


def torchcodec_installed(box: Box) -> bool:
    """Whether the device wheels' TorchCodec installed for this Python (on 3.12, yes; whether it loads is another
    question, answered by the code that imports it)."""
    return any(name.startswith("torchcodec") and status == "installed" for name, status in box.installed.items())
