"""The code's shape: imports flow one way, between modules (no cycle, counting `from imgtrain.pkg import x` as an
import of the package, its __init__, too) and between packages (none imports one above it in the order
docs/development.md gives); no function over 60 lines, and no file of the engine over 350 (the files a fork grows
are exempt: FORK_GROWS)."""

from __future__ import annotations

import ast
import re

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


def _documented_package_order() -> list[str]:
    """The line of docs/development.md that reads "Packages, bottom up: `common` -> `config` -> ..."."""
    match = re.search(r"^Packages, bottom up: (.+)$", (ROOT / "docs" / "development.md").read_text(), re.MULTILINE)
    assert match, "docs/development.md lost its 'Packages, bottom up:' line"
    return re.findall(r"`(\w+)`", match.group(1))


def _package(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if parts[0] == "imgtrain" and len(parts) >= 2 else None  # imgtrain.<package>[.<module>]


def test_packages_import_only_packages_below_them_in_the_documented_order() -> None:
    order = _documented_package_order()
    modules = _modules()
    packages = {_package(name) for name in modules if name.startswith("imgtrain.")} - {None}
    assert packages <= set(order), f"packages missing from docs/development.md's order: {packages - set(order)}"
    upward = [
        f"{name} -> {target}"
        for name, tree in modules.items()
        for target in _imports(name, tree, set(modules))
        if (source := _package(name)) and (dest := _package(target)) and order.index(dest) > order.index(source)
    ]
    assert not upward, "imports against the package order: " + "; ".join(sorted(upward))


MAX_FUNCTION_LINES = 60  # docs/development.md's size rule: functions under 60 lines


def test_no_function_in_src_is_over_60_lines() -> None:
    long = []
    for path in SRC.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                if lines > MAX_FUNCTION_LINES:
                    long.append(f"{path.relative_to(SRC)}:{node.lineno} {node.name}: {lines} lines")
    assert not long, long


MAX_FILE_LINES = 350  # docs/development.md's size rule: files under 350 lines

# The files a fork is meant to grow (its models, its loss and schedule, its datasets and their config keys): the
# size rule keeps the engine readable, and must not fail a fork's first change to its own recipe.
FORK_GROWS: set[str] = set()


def test_no_engine_file_in_src_is_over_350_lines() -> None:
    assert all((SRC / name).is_file() for name in FORK_GROWS), "FORK_GROWS names a file that moved"
    long = [
        f"{path.relative_to(SRC)}: {n}"
        for path in SRC.rglob("*.py")
        if str(path.relative_to(SRC)) not in FORK_GROWS and (n := len(path.read_text().splitlines())) > MAX_FILE_LINES
    ]
    assert not long, long


def test_the_loop_and_the_step_reach_measuring_only_through_the_instruments() -> None:
    """train/loop.py and train/step.py call whatever measures the run through train/instruments.py's hooks: they
    import nothing from imgtrain.metrics (the ranks' agreement is resilience/agreement.py's, not a metric)."""
    modules = _modules()
    for name in ("imgtrain.train.loop", "imgtrain.train.step", "imgtrain.train.instruments"):
        reached = _imports(name, modules[name], set(modules))
        assert not {target for target in reached if target.split(".")[:2] == ["imgtrain", "metrics"]}, name
