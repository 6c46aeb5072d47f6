"""benchmarks/ scripts import each other as plain modules (run with benchmarks/ on the path),
outside import-linter's view of meshtron: no circle among them either, at any depth (an import
inside a function included), so each script loads on its own."""

from __future__ import annotations

import ast
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def sibling_imports(path: Path, siblings: set[str]) -> set[str]:
    """The benchmarks/ modules that ``path`` imports, anywhere in it."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.add(node.module.split(".")[0])
    return found & siblings - {path.stem}


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every import path that comes back to where it started (depth-first, each once)."""
    found, done = [], set()

    def walk(name: str, path: list[str]) -> None:
        for target in sorted(graph[name]):
            if target in path:
                found.append([*path[path.index(target):], target])
            elif target not in done:
                walk(target, [*path, target])
        done.add(name)

    for name in sorted(graph):
        if name not in done:
            walk(name, [name])
    return found


def test_no_import_circle_among_benchmarks():
    packages = [p for p in BENCHMARKS.iterdir() if (p / "__init__.py").is_file()]
    siblings = {p.stem for p in BENCHMARKS.glob("*.py")} | {p.name for p in packages}
    graph = {p.stem: sibling_imports(p, siblings) for p in BENCHMARKS.glob("*.py")}
    graph |= {p.name: set().union(*(sibling_imports(f, siblings) for f in p.rglob("*.py")))
              - {p.name} for p in packages}  # a package's own submodules are not a circle
    assert graph["pipeline"] >= {"pipeline_bound", "pipeline_shape"}  # the scan sees imports
    assert circles(graph) == []


def test_the_circle_finder_finds_one():
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == [["a", "b", "c", "a"]]
    assert circles({"a": {"b"}, "b": set()}) == []
