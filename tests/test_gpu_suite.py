"""The GPU suite cannot rot unseen on a machine without a GPU.

`make test` collects tests/test_gpu.py (every test skips without CUDA), so an import at its top that breaks
fails here too. What collection does not reach: the imports inside functions and inside the code strings that
GPU tests hand to `python -c`, the benchmark harness's scripts, and the train.py overrides its GPU sections
pass. A module that moved (imgtrain.monitor -> imgtrain.metrics.monitor) once broke `make test-gpu` for
certain and nothing on CPU noticed; these checks would have.
"""

from __future__ import annotations

import ast
import importlib
import sys
from pathlib import Path

import pytest
import torch
from helpers import ROOT, compose_cfg

from imgtrain.config.validate import validate
from imgtrain.metrics.spread import MIN_WINDOWS

GPU_SOURCES = [ROOT / "tests" / name for name in ("test_gpu.py", "test_gpu_augment.py", "test_profiling.py")]
BENCHMARKS = sorted((ROOT / "benchmarks").glob("*.py"))
LOCAL_DIRS = [ROOT / "tests", ROOT / "benchmarks"]  # `from helpers import ...`, `from storage import ...`


def _code_strings(tree: ast.AST) -> list[tuple[ast.Module, int]]:
    """String constants that parse as Python with an import in them (`python -c` programs), with their line."""
    programs = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and "import" in node.value:
            try:
                program = ast.parse(node.value)
            except SyntaxError:
                continue
            programs.append((program, node.lineno))
    return programs


def imports_in(path: Path) -> list[tuple[str, str | None, int]]:
    """(module, name or None, line) of every absolute import in `path`: at the top, inside functions, and
    inside the code strings it runs."""
    tree = ast.parse(path.read_text(), filename=str(path))
    found = []
    for program, string_line in [(tree, None), *_code_strings(tree)]:
        for node in ast.walk(program):
            if isinstance(node, ast.Import):
                found += [(alias.name, None, string_line or node.lineno) for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module != "__future__":
                found += [(node.module, alias.name, string_line or node.lineno) for alias in node.names]
    return found


def unresolved(module: str, name: str | None) -> str | None:
    """Why `from module import name` (or `import module`) would fail, or None."""
    try:
        imported = importlib.import_module(module)
    except ImportError as error:
        return f"{module}: {error}"
    if name is None or name == "*" or hasattr(imported, name):
        return None
    try:
        importlib.import_module(f"{module}.{name}")  # a submodule
    except ImportError:
        return f"{module} has no {name}"
    return None


@pytest.mark.parametrize("path", GPU_SOURCES + BENCHMARKS, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_every_name_the_gpu_tests_and_benchmarks_import_exists(path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for directory in LOCAL_DIRS:
        monkeypatch.syspath_prepend(str(directory))
    imports = imports_in(path)
    assert imports, f"no import found in {path}: the check reads nothing"
    problems = [f"line {line}: {why}" for module, name, line in imports if (why := unresolved(module, name))]
    assert not problems, f"{path.name}: " + "; ".join(problems)


def test_the_import_check_sees_imports_inside_code_strings(tmp_path: Path) -> None:
    """What broke test_nvml_follows_cuda_visible_devices: a moved module named inside a `python -c` string."""
    source = tmp_path / "sample.py"
    source.write_text('code = (\n    "import torch\\n"\n    "from imgtrain.monitor import ResourceMonitor\\n"\n)\n')
    found = imports_in(source)
    assert ("imgtrain.monitor", "ResourceMonitor", 2) in found  # the line the string starts on
    assert unresolved("imgtrain.monitor", "ResourceMonitor") is not None
    assert unresolved("imgtrain.metrics.monitor", "ResourceMonitor") is None
    assert unresolved("imgtrain.metrics.monitor", "NoSuchName") == "imgtrain.metrics.monitor has no NoSuchName"


def test_the_gpu_tests_are_collected_here() -> None:
    """The suite `make test-gpu` runs is importable on CPU and holds its tests (they skip here, never vanish)."""
    module = importlib.import_module("test_gpu")
    tests = [name for name in vars(module) if name.startswith("test_")]
    assert len(tests) >= 14, tests
    marks = {mark.name for mark in module.pytestmark}
    assert {"gpu", "skipif"} <= marks


class _ComposingBench:
    """A stand-in for bench.Bench whose `train` composes and validates the overrides instead of running them."""

    quick = True

    def __init__(self, workdir: Path) -> None:
        self.workdir, self.composed = workdir, []

    def train(self, *overrides: str, **_: object) -> dict:
        validate(compose_cfg(*overrides, output_dir=str(self.workdir / "run")))
        self.composed.append(overrides)
        return {"command": " ".join(overrides), "error": "composed only"}


def test_the_benchmarks_gpu_sections_pass_overrides_that_compose(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every train.py command of `--only gpu-ceilings,gpu-jpeg` is a config the current schema accepts."""
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    bench = importlib.import_module("bench")
    folder = bench.photos.ensure_folder(tmp_path / "photos", (20, 10), scale=0.1)  # the mixed-size folder, tiny
    monkeypatch.setattr(bench, "jpeg_folder", lambda _: folder)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # the sections skip themselves without CUDA
    fake = _ComposingBench(tmp_path)
    rows = bench.gpu_ceilings(fake, steps=12, warmup=2)
    jpeg = bench.gpu_jpeg(fake, steps=12, warmup=2, timm=None)
    rows += jpeg["rows"]
    assert len(fake.composed) == len(rows) >= 10
    assert "mode=compute" in fake.composed[0]
    assert jpeg["folder"]["train_files"] == 20 and f"dataset.root={folder}" in fake.composed[-1]
    assert sys.modules["bench"] is bench


@pytest.mark.parametrize("scale", ["FULL", "QUICK"])
def test_the_gpu_check_rows_pass_overrides_that_compose(
    scale: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every row of `make gpu-check` (benchmarks/gpu_rows.py's check_rows), at the H100's size and the smoke test's,
    is a config the current schema accepts on a CUDA machine, with the steps its table states."""
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    gpu_rows = importlib.import_module("gpu_rows")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    (tmp_path / "photos").mkdir()  # validate asks for the folder, which the check generates before these rows
    rows = gpu_rows.check_rows(getattr(gpu_rows, scale), str(tmp_path / "photos"), "auto", gpu_decoder="torchvision")
    assert [row.key for row in rows][:3] == ["r50_ceiling_compiled", "r50_jpeg_cuda", "r50_jpeg_cpu"]
    assert len(rows) == 11
    for row in rows:
        cfg = compose_cfg(*row.args, output_dir=str(tmp_path / row.key))
        validate(cfg)
        assert (cfg.train.max_steps, cfg.metrics.skip_first_steps, cfg.metrics.log_every_n_steps) == row.steps
        assert (row.steps[0] - row.steps[1]) // row.steps[2] >= MIN_WINDOWS  # enough windows for an interval
    if scale == "FULL":  # what the rows are
        args = {row.key: " ".join(row.args) for row in rows}
        assert "compile_mode=reduce_overhead" in args["r18_ceiling_graphs"] and "bf16" in args["r18_ceiling"]
        assert "augment_on" not in args["r18_dataloader"]  # the default placement
        assert "dataset.decode=cuda" in args["r50_jpeg_cuda"] and "system.compile=true" in args["r50_jpeg_cpu"]
        assert "dataset.gpu_decoder=torchvision" in args["r50_jpeg_cuda"]  # the decoder part's choice
        assert (
            "data.num_workers=tune" in args["r18_dataloader_tune"] and "data.num_workers=auto" in args["r18_dataloader"]
        )
        assert "compile_mode=reduce_overhead" in args["r18_dataloader_graphs"] and "r50" not in args["r18_dataloader"]
