"""The code's shape (issue 19): imports flow one way (config -> dist -> data/model -> metrics/checkpoint -> loop
-> run), with no cycle between imgtrain's modules, counting `from imgtrain.pkg import x` as an import of the
package (its __init__) too; no function over 60 lines, and no file of the engine over 350 (the files a fork grows
are exempt: FORK_GROWS)."""

from __future__ import annotations

import ast

from helpers import ROOT

SRC = ROOT / "src"


def _modules() -> dict[str, ast.Module]:
    found = {}
    for path in SRC.rglob("*.py"):
        parts = list(path.relative_to(SRC).with_suffix("").parts)
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        found[name] = ast.parse(path.read_text())
    return found


def _imports(name: str, tree: ast.Module, known: set[str]) -> set[str]:
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            out.add(node.module)  # the package itself: its __init__ runs
            out |= {f"{node.module}.{alias.name}" for alias in node.names}
    return {target for target in out if target in known and target != name}


def test_no_import_cycle_between_imgtrain_modules() -> None:
    modules = _modules()
    graph = {name: _imports(name, tree, set(modules)) for name, tree in modules.items()}
    state: dict[str, str] = {}  # "open" while on the path, "done" after

    def visit(node: str, path: list[str]) -> None:
        state[node] = "open"
        for nxt in sorted(graph[node]):
            assert state.get(nxt) != "open", "import cycle: " + " -> ".join([*path[path.index(nxt) :], nxt])
            if nxt not in state:
                visit(nxt, [*path, nxt])
        state[node] = "done"

    for name in sorted(graph):
        if name not in state:
            visit(name, [name])


MAX_FUNCTION_LINES = 60  # the project's rule: functions under about 60 lines


def test_no_function_in_src_is_over_60_lines() -> None:
    long = []
    for path in SRC.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                if lines > MAX_FUNCTION_LINES:
                    long.append(f"{path.relative_to(SRC)}:{node.lineno} {node.name}: {lines} lines")
    assert not long, long


MAX_FILE_LINES = 350  # the project's rule: files under about 350 lines

# The files a fork is meant to grow (its models, its loss and schedule, its datasets and their config keys): the
# size rule keeps the engine readable, and must not fail a fork's first change to its own recipe.
FORK_GROWS = {
    "imgtrain/train/model.py",
    "imgtrain/train/step.py",
    "imgtrain/data/datasets.py",
    "imgtrain/config/schema.py",
    "imgtrain/config/datasets.py",
}


def test_no_engine_file_in_src_is_over_350_lines() -> None:
    assert all((SRC / name).is_file() for name in FORK_GROWS), "FORK_GROWS names a file that moved"
    long = [
        f"{path.relative_to(SRC)}: {n}"
        for path in SRC.rglob("*.py")
        if str(path.relative_to(SRC)) not in FORK_GROWS and (n := len(path.read_text().splitlines())) > MAX_FILE_LINES
    ]
    assert not long, long
