"""No import circle among lightning_sparse's modules, read from the source (AST): every import
statement counts, the ones inside functions too (a lazy import still ties two modules together).

`SCOPES` lists the packages checked, each a parameter of the test, with the subpackages left out
of it. A circle is reported as the modules in order (``a -> b -> a``) with the line of each
import.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]  # the folder that holds lightning_sparse/
# The packages whose modules must not import each other in a circle: {package: subpackages left
# out}. The whole package, nothing left out.
SCOPES: dict[str, tuple[str, ...]] = {"lightning_sparse": ()}

Graph = dict[str, dict[str, int]]  # module -> {module it imports: line of the first import}


def module_files(root: Path, scope: str) -> dict[str, Path]:
    """``{module name: file}`` for every module of the package ``scope`` under ``root`` (a
    package is named by its ``__init__.py``)."""
    base = root.joinpath(*scope.split("."))
    files = {}
    for path in sorted(base.rglob("*.py")):
        parts = path.relative_to(root).with_suffix("").parts
        files[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return files


def imported_modules(path: Path, root: Path, known: set[str]) -> dict[str, int]:
    """The modules of ``known`` that ``path`` imports, with the line of the first import:
    ``import a.b``, ``from a import b`` (``a.b`` where it is a module, else ``a``) and relative
    imports, at any depth of the file."""
    parts = path.relative_to(root).with_suffix("").parts
    package = parts[:-1]  # a module's package; for __init__.py the package itself
    found: dict[str, int] = {}

    def add(name: str, line: int) -> None:
        if name in known:
            found.setdefault(name, line)

    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                add(alias.name, node.lineno)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = list(package[: len(package) - node.level + 1])
                source = ".".join([*base, node.module] if node.module else base)
            else:
                source = node.module or ""
            for alias in node.names:
                submodule = f"{source}.{alias.name}"
                add(submodule if submodule in known else source, node.lineno)
    return found


def import_graph(root: Path, scope: str, exclude: tuple[str, ...] = ()) -> Graph:
    files = {
        name: path
        for name, path in module_files(root, scope).items()
        if not any(name == out or name.startswith(out + ".") for out in exclude)
    }
    known = set(files)
    graph = {name: imported_modules(path, root, known) for name, path in files.items()}
    for name, imports in graph.items():
        imports.pop(name, None)  # a module naming itself (`from pkg import x` inside pkg/x.py)
    return graph


def circles(graph: Graph) -> list[list[str]]:
    """One circle (``[a, b, ..., a]``) for each group of modules that import each other
    (strongly connected components, Tarjan's algorithm), in a stable order."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    groups: list[list[str]] = []

    def connect(node: str) -> None:  # recursion depth <= number of modules
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for successor in sorted(graph[node]):
            if successor not in index:
                connect(successor)
                low[node] = min(low[node], low[successor])
            elif successor in on_stack:
                low[node] = min(low[node], index[successor])
        if low[node] == index[node]:
            group = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                group.append(member)
                if member == node:
                    break
            if len(group) > 1:
                groups.append(sorted(group))

    for node in sorted(graph):
        if node not in index:
            connect(node)
    return [_path_through(graph, set(group)) for group in sorted(groups)]


def _path_through(graph: Graph, group: set[str]) -> list[str]:
    """A circle inside ``group`` starting and ending at its first module (breadth first: the
    shortest way back)."""
    start = min(group)
    came_from: dict[str, str] = {}
    frontier = [start]
    while frontier:
        following = []
        for node in frontier:
            for successor in sorted(graph[node]):
                if successor == start:
                    path = [node]
                    while path[-1] != start:
                        path.append(came_from[path[-1]])
                    return [*reversed(path), start]
                if successor in group and successor not in came_from:
                    came_from[successor] = node
                    following.append(successor)
        frontier = following
    raise AssertionError(f"{sorted(group)} is not a circle")


def describe(graph: Graph, circle: list[str]) -> str:
    steps = [f"{a} (line {graph[a][b]}) -> {b}" for a, b in zip(circle, circle[1:], strict=False)]
    return "  " + "\n  ".join(steps)


@pytest.mark.parametrize("scope", sorted(SCOPES))
def test_no_import_circle(scope: str) -> None:
    graph = import_graph(ROOT, scope, SCOPES[scope])
    assert len(graph) > 1, f"no modules found for {scope}"
    found = circles(graph)
    assert not found, f"import circles in {scope}:\n" + "\n".join(
        describe(graph, circle) for circle in found
    )


def test_the_check_finds_circles_lazy_relative_and_through_packages(tmp_path: Path) -> None:
    """A package with three circles (one through a function-level import, one through a
    relative ``from . import``, one through the package's ``__init__``) and a clean module."""
    package = tmp_path / "pkg"
    (package / "sub").mkdir(parents=True)
    files = {
        "__init__.py": "from pkg import c\n",
        "a.py": "import os\nfrom pkg import b\n",
        "b.py": "def lazy():\n    from pkg.a import x\n",
        "c.py": "import pkg\n",
        "clean.py": "import pkg.a\nfrom pkg.sub import d\n",
        "sub/__init__.py": "",
        "sub/d.py": "from . import e\n",
        "sub/e.py": "from .d import f\n",
    }
    for name, text in files.items():
        (package / name).write_text(text)
    graph = import_graph(tmp_path, "pkg")
    assert graph["pkg.clean"] == {"pkg.a": 1, "pkg.sub.d": 2}
    found = circles(graph)
    assert found == [
        ["pkg", "pkg.c", "pkg"],
        ["pkg.a", "pkg.b", "pkg.a"],
        ["pkg.sub.d", "pkg.sub.e", "pkg.sub.d"],
    ]
    assert "pkg.b (line 2) -> pkg.a" in describe(graph, found[1])
    assert circles(import_graph(tmp_path, "pkg.sub")) == [["pkg.sub.d", "pkg.sub.e", "pkg.sub.d"]]
    assert circles(import_graph(tmp_path, "pkg", ("pkg.sub",))) == found[:2]  # left out
