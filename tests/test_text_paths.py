"""Every module path that the text names exists (issue 40): README.md, docs/*.md, the comments of conf/**/*.yaml, and
the docstrings and comments of src/**/*.py and of benchmarks/ (its scripts, not its dated results/).

What counts as a module path:
- dotted `imgtrain.x.y`: src/imgtrain/x/y.py or the package src/imgtrain/x/y/, and `imgtrain.x.y.Name` when y.py
  (or the package's __init__.py) names `Name`;
- a slash path ending in .py, .yaml, .md or .patch (`src/imgtrain/x/y.py`, `data/loader.py`, `conf/x/y.yaml`,
  `tests/test_x.py`, `../BENCHMARKS.md`): some file of the repository is that path or ends with it, so a path
  relative to src/imgtrain/, conf/, the repository or the citing file's folder is found, and a module that moved
  (`metrics/probe.py`, now train/probe.py) is not;
- an extensionless slash path under a top folder (`src/`, `conf/`, `tests/`, ...) or a package (`data/shards`):
  a folder or module, unless the code writes it as a name (the TensorBoard tag `train/loss`, the profiler's
  `imgtrain/h2d`);
- a bare document name (`BENCHMARKS.md`): some file of the repository has it, or the code writes it.
A path that begins with an installed package's name (`hydra/help/default.yaml`) may name that package's file.
Not checked: URLs, paths under a hidden folder or outputs/ (what a run writes), other extensions (a user's
`data/train.csv`), bare .py names (a user's `my_data.py`), placeholders (`tests/test_x.py`; before a `<`, as in
`conf/loss/<name>.yaml`, what precedes it must exist), and the first column of docs/development.md's table of
former module paths.
"""

from __future__ import annotations

import importlib.util
import io
import os
import re
import tokenize
from collections.abc import Iterator
from functools import cache
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src"
PACKAGE = SRC / "imgtrain"
# Not part of the repository's text: environments, caches, what runs and builds write.
SKIPPED_DIRS = {".git", ".venv", "__pycache__", "outputs", "multirun", ".device", ".pytest_cache", ".ruff_cache"}
TOP_FOLDERS = {"src", "conf", "tests", "benchmarks", "docs", "imgtrain"}
FILE_EXTENSIONS = (".py", ".yaml", ".md", ".patch")
# Extensionless pairs that are words, not paths: "a train/val split".
WORDS = {"train/val"}

DOTTED = re.compile(r"(?<![\w/.-])imgtrain(?:\.[A-Za-z_]\w*)+")
# No match inside a URL, a home or absolute path, or a longer word.
SLASH = re.compile(r"(?<![\w/.~:$@<>{}%+-])((?:\.{1,2}/)*(?:[\w.-]+/)+[\w.-]*\w)(.?)")
BARE = re.compile(r"(?<![\w/.~:$@<>{}%+-])([A-Za-z_][\w-]*\.md)\b(?![/\w-])")
# A path part that stands for any: x, y, test_x.
PLACEHOLDER = re.compile(r"^(?:\w+_)?[a-z](?:\.\w+)?$")


@cache
def repo_paths() -> frozenset[str]:
    """Every file and folder of the working tree, relative to the root, as posix paths."""
    found: set[str] = set()
    for folder, dirs, files in os.walk(ROOT):
        dirs[:] = [d for d in dirs if d not in SKIPPED_DIRS and not d.endswith(".egg-info")]
        rel = Path(folder).relative_to(ROOT)
        found.update((rel / name).as_posix() for name in [*dirs, *files])
    return frozenset(found)


@cache
def basenames() -> frozenset[str]:
    return frozenset(p.rsplit("/", 1)[-1] for p in repo_paths())


@cache
def source_text() -> str:
    """All of src/'s Python, to find the names the code writes."""
    return "\n".join(p.read_text() for p in sorted(SRC.rglob("*.py")))


def _found(path: str) -> bool:
    return any(p == path or p.endswith(f"/{path}") for p in repo_paths())


def _defines(module: Path, name: str) -> bool:
    return re.search(rf"\b{re.escape(name)}\b", module.read_text()) is not None


def dotted_exists(dotted: str) -> bool:
    """`imgtrain.x.y[.Name...]`: the longest module prefix exists and, after it, its first name is in it."""
    parts = dotted.split(".")[1:]
    folder, module = PACKAGE, PACKAGE / "__init__.py"
    for i, part in enumerate(parts):
        if (folder / part / "__init__.py").is_file():
            folder, module = folder / part, folder / part / "__init__.py"
        elif (folder / f"{part}.py").is_file():
            rest = parts[i + 1 :]
            return not rest or _defines(folder / f"{part}.py", rest[0])
        else:
            return _defines(module, part)
    return True


def _installed_file(path: str) -> bool:
    """`path` is a file of the installed package its first part names (Hydra's hydra/help/default.yaml)."""
    head = path.split("/", 1)[0]
    spec = importlib.util.find_spec(head) if head.isidentifier() else None
    folders = spec.submodule_search_locations if spec else None
    return any(p.as_posix().endswith(f"/{path}") for folder in folders or () for p in Path(folder).rglob("*"))


def _writes_name(path: str) -> bool:
    """The code writes `path` as a name: the string itself, or its namespace and its last part (`PREFIX + name`)."""
    code = source_text()
    if re.search(rf"[\"']{re.escape(path)}[\"']", code):
        return True
    head, last = path.split("/", 1)[0], path.rsplit("/", 1)[-1]
    return bool(re.search(rf"[\"']{re.escape(head)}/", code) and re.search(rf"[\"']{re.escape(last)}[\"']", code))


def slash_exists(raw: str, after: str) -> bool | None:
    """True or False for a module path, None for a path this test does not judge."""
    path = re.sub(r"^(?:\.{1,2}/)+", "", raw)
    head = path.split("/", 1)[0]
    if head.startswith(".") or head in SKIPPED_DIRS or any(PLACEHOLDER.match(part) for part in path.split("/")):
        return None
    if after and after in "<*{[":  # a placeholder follows: what precedes it must begin some path
        return any(p.startswith(path) or f"/{path}" in p for p in repo_paths()) if head in TOP_FOLDERS else None
    if path.endswith(FILE_EXTENSIONS):
        return _found(path) or (head not in TOP_FOLDERS and not (PACKAGE / head).is_dir() and _installed_file(path))
    if "." in path.rsplit("/", 1)[-1] or (head not in TOP_FOLDERS and not (PACKAGE / head).is_dir()):
        return None  # another kind of file (a user's data/train.csv), or words (images/s, mixup/cutmix)
    if _found(path) or _found(f"{path}.py") or path in WORDS:
        return True
    return _writes_name(path)


def _python_text(path: Path) -> Iterator[tuple[int, str]]:
    """Comments, and strings that stand as statements (docstrings), line by line."""
    previous = tokenize.NEWLINE
    for token in tokenize.generate_tokens(io.StringIO(path.read_text()).readline):
        if token.type == tokenize.COMMENT:
            yield token.start[0], token.string
        elif token.type == tokenize.STRING and previous in (tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT):
            for offset, line in enumerate(token.string.splitlines()):
                yield token.start[0] + offset, line
        if token.type not in (tokenize.COMMENT, tokenize.NL):
            previous = token.type


def _markdown_text(path: Path) -> Iterator[tuple[int, str]]:
    """Each line; in a table whose first header cell names former paths, each row without that cell."""
    former = False
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if not line.startswith("|"):
            former = False
        elif line.lower().startswith("| former"):
            former = True
        elif former:
            line = line.split("|", 2)[-1]
        yield number, line


def text_lines() -> Iterator[tuple[Path, int, str]]:
    for page in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        yield from ((page, n, line) for n, line in _markdown_text(page))
    for conf in sorted((ROOT / "conf").rglob("*.yaml")):
        for number, line in enumerate(conf.read_text().splitlines(), 1):
            if "#" in line:
                yield conf, number, line[line.index("#") :]
    benchmarks = [p for p in sorted((ROOT / "benchmarks").rglob("*.py")) if "results" not in p.parts]  # not records
    for module in [*sorted(SRC.rglob("*.py")), *benchmarks]:
        yield from ((module, n, line) for n, line in _python_text(module))


def misses_in(line: str) -> list[str]:
    """The module paths named in `line` that do not exist."""
    line = re.sub(r"\b[a-z][a-z+]*://\S+", "", line)  # URLs
    missing = [name for name in DOTTED.findall(line) if not dotted_exists(name)]
    missing += [raw for raw, after in SLASH.findall(line) if slash_exists(raw, after) is False]
    bare = [name for name in BARE.findall(line) if name not in basenames() and not _writes_name(name)]
    return missing + bare


def test_every_module_path_named_in_the_text_exists() -> None:
    misses = [
        f"{path.relative_to(ROOT)}:{number}: {name}" for path, number, line in text_lines() for name in misses_in(line)
    ]
    assert not misses, "the text names module paths that do not exist:\n" + "\n".join(misses)


def test_the_matcher_catches_a_moved_module_and_spares_what_is_not_a_module_path() -> None:
    moved = [
        "see metrics/probe.py",
        "(src/imgtrain/metrics/probe.py)",
        "`imgtrain.metrics.probe`",
        "imgtrain.train.probe.NoSuchName",
        "conf/schedule/cosine.yaml",
        "tests/test_nothing_here.py",
        "metrics/pipeline",
        "NO_SUCH_FILE.md",
        "hydra/help/no_such.yaml",
    ]
    for line in moved:
        assert misses_in(line), line
    fine = [
        "train/probe.py, data/loader.py and resilience/checkpoint/files.py",
        "imgtrain.train.probe.ModelProbe and imgtrain.data.shards",
        "https://github.com/pytorch/pytorch/blob/main/torch/utils/data/dataloader.py",
        "data/train.csv, /data/imagenet/train, ~/.cache/imgtrain/cifar, outputs/x/.hydra/config.yaml",
        "images/s, mixup/cutmix, train/loss, imgtrain/h2d, pytorch/pytorch#13246",
        "conf/loss/<name>.yaml, schedule/step.yaml, ../BENCHMARKS.md, tests/test_docs.py, tests/test_x.py",
        "hydra/help/default.yaml, sweep_summary.md, my_data.py",
    ]
    for line in fine:
        assert not misses_in(line), (line, misses_in(line))
