"""No import cycle in envd/ or host/, not even one a function-level import hides.

The graph has an edge for every `import` / `from ... import` of a module of the same
package, of one of three kinds (the strongest wins when a module imports another twice):

- `module`: runs at import time (module level, class bodies, module-level if/try);
- `function`: inside a def or lambda, runs on first call;
- `typing`: under `if TYPE_CHECKING:`, never runs.

A cycle is an error when it runs (all its edges are `module`/`function`) or when one of
its edges is a `function` import: that import only postpones the cycle. A cycle closed
by a `typing` edge over `module` edges is the cycle-breaking pattern STYLE.md names
(a type hint pointing back up) and is allowed.
`from pkg import name` points at `pkg.name` when that is a module, else at `pkg`.

Run as a script to print each package's cycles: `python tests/envd/test_import_graph.py`.
"""

from __future__ import annotations

import ast
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

# Cycles that exist today and are being removed elsewhere; each entry is one cycle's set
# of modules. Delete an entry once its cycle is gone (the test then passes instead of
# xfailing, and a new cycle through these modules fails it).
KNOWN_CYCLES: set[frozenset[str]] = set()  # none: keep it that way

MODULE, FUNCTION, TYPING = "module", "function", "typing"
_STRENGTH = {TYPING: 0, FUNCTION: 1, MODULE: 2}
Graph = dict[str, dict[str, str]]  # module -> {imported module: edge kind}


def package_modules(package: str) -> dict[str, Path]:
    """Dotted module name -> file, for every .py file of `package` under the repo."""
    modules = {}
    for path in sorted((REPO / package).rglob("*.py")):
        parts = list(path.relative_to(REPO).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        modules[".".join(parts)] = path
    return modules


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imports(node: ast.AST, kind: str) -> Iterator[tuple[ast.Import | ast.ImportFrom, str]]:
    """Every import statement under `node` with the kind of edge it makes."""
    for child in ast.iter_child_nodes(node):
        if isinstance(child, ast.Import | ast.ImportFrom):
            yield child, kind
        elif isinstance(child, ast.If) and _is_type_checking(child.test):
            for stmt in child.body:
                yield from _imports(ast.Module(body=[stmt], type_ignores=[]), TYPING)
            for stmt in child.orelse:
                yield from _imports(ast.Module(body=[stmt], type_ignores=[]), kind)
        elif isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda):
            yield from _imports(child, TYPING if kind == TYPING else FUNCTION)
        else:
            yield from _imports(child, kind)


def _targets(module: str, is_package: bool, node: ast.Import | ast.ImportFrom,
             known: dict[str, Path]) -> Iterator[str]:
    if isinstance(node, ast.Import):
        for alias in node.names:
            yield alias.name
        return
    if node.level:
        base = module.split(".") if is_package else module.split(".")[:-1]
        base = base[:len(base) - (node.level - 1)]
        source = ".".join(base + ([node.module] if node.module else []))
    else:
        source = node.module or ""
    for alias in node.names:
        submodule = f"{source}.{alias.name}"
        yield submodule if submodule in known else source


def import_graph(package: str) -> Graph:
    """Module -> {module of the same package it imports: strongest edge kind}."""
    known = package_modules(package)
    graph: Graph = {}
    for module, path in known.items():
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        edges: dict[str, str] = {}
        for node, kind in _imports(tree, MODULE):
            for target in _targets(module, path.name == "__init__.py", node, known):
                if target in known and target != module and \
                        _STRENGTH[kind] > _STRENGTH.get(edges.get(target, ""), -1):
                    edges[target] = kind
        graph[module] = edges
    return graph


def strongly_connected(graph: dict[str, set[str]]) -> list[frozenset[str]]:
    """The strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[frozenset[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph.get(node, ())):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = set()
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.add(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(frozenset(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def _path(graph: Graph, start: str, goal: str) -> list[str] | None:
    """Shortest import path start -> ... -> goal over edges of every kind (BFS)."""
    previous: dict[str, str | None] = {start: None}
    frontier = [start]
    while frontier:
        nxt_frontier = []
        for node in frontier:
            for nxt in sorted(graph.get(node, {})):
                if nxt in previous:
                    continue
                previous[nxt] = node
                if nxt == goal:
                    path = [goal]
                    while previous[path[-1]] is not None:
                        path.append(previous[path[-1]])  # type: ignore[arg-type]
                    return path[::-1]
                nxt_frontier.append(nxt)
        frontier = nxt_frontier
    return None


def bad_cycles(graph: Graph) -> list[frozenset[str]]:
    """Cycles that run (module/function edges only) or that a function-level import hides."""
    runtime = {m: {t for t, k in edges.items() if k != TYPING} for m, edges in graph.items()}
    found = strongly_connected(runtime)
    for module, edges in sorted(graph.items()):
        for target, kind in sorted(edges.items()):
            back = _path(graph, target, module) if kind == FUNCTION else None
            if back is not None and not any(set(back) <= c for c in found):
                found.append(frozenset(back))
    return found


def describe(cycle: frozenset[str], graph: Graph) -> str:
    edges = sorted(f"{a} -> {b} ({k})" for a in cycle for b, k in graph[a].items() if b in cycle)
    return "{" + ", ".join(sorted(cycle)) + "}: " + "; ".join(edges)


def test_strongly_connected():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": set()}
    assert strongly_connected(graph) == [frozenset({"a", "b", "c"})]


def test_edge_kinds_and_which_cycles_are_bad(tmp_path, monkeypatch):
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    files = {
        "__init__.py": "from .sub import a\n",
        "sub/__init__.py": "",
        # a -> b in a function, b -> a for types only: the function import hides a cycle
        "sub/a.py": "def f():\n    from . import b\n",
        "sub/b.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .a import f\n",
        # c -> d at module level, d -> c for types only: the allowed pattern
        "sub/c.py": "from . import d\nclass C:\n    from pkg import sub\n",
        "sub/d.py": "import typing\nif typing.TYPE_CHECKING:\n    from pkg.sub.c import C\n"
                    "else:\n    import pkg\n",
    }
    for name, text in files.items():
        (pkg / name).write_text(text)
    monkeypatch.setattr(sys.modules[__name__], "REPO", tmp_path)
    graph = import_graph("pkg")
    assert graph == {
        "pkg": {"pkg.sub.a": MODULE}, "pkg.sub": {},
        "pkg.sub.a": {"pkg.sub.b": FUNCTION}, "pkg.sub.b": {"pkg.sub.a": TYPING},
        "pkg.sub.c": {"pkg.sub.d": MODULE, "pkg.sub": MODULE},
        "pkg.sub.d": {"pkg.sub.c": TYPING, "pkg": MODULE},
    }
    # c -> d -> pkg -> a -> b runs at import time but never comes back: no cycle there.
    assert bad_cycles(graph) == [frozenset({"pkg.sub.a", "pkg.sub.b"})]
    graph["pkg.sub.b"]["pkg.sub.a"] = MODULE  # now a runtime cycle
    assert bad_cycles(graph) == [frozenset({"pkg.sub.a", "pkg.sub.b"})]


@pytest.mark.parametrize("package", ["envd", "host"])
def test_import_graph_is_acyclic(package):
    if not (REPO / package).is_dir():
        pytest.skip(f"no {package}/ in this checkout")
    graph = import_graph(package)
    found = bad_cycles(graph)
    unexpected = [c for c in found if c not in KNOWN_CYCLES]
    assert not unexpected, "import cycles:\n" + "\n".join(describe(c, graph) for c in unexpected)
    # stricter than bad_cycles(): not even a TYPE_CHECKING import closes a cycle here
    every = {m: set(edges) for m, edges in graph.items()}
    typed = [c for c in strongly_connected(every) if c not in KNOWN_CYCLES]
    assert not typed, "cycles closed by TYPE_CHECKING imports:\n" + "\n".join(
        describe(c, graph) for c in typed)
    known = [c for c in found if c in KNOWN_CYCLES]
    if known:
        pytest.xfail("known import cycles (KNOWN_CYCLES): "
                     + "; ".join(describe(c, graph) for c in known))


if __name__ == "__main__":
    for name in ("envd", "host"):
        g = import_graph(name)
        print(f"{name}: {len(g)} modules, {sum(map(len, g.values()))} edges")
        for c in bad_cycles(g):
            print("  cycle", describe(c, g), "(known)" if c in KNOWN_CYCLES else "")
        bad = bad_cycles(g)
        every = {m: set(edges) for m, edges in g.items()}
        for c in strongly_connected(every):
            if not any(b <= c for b in bad):
                print("  closed by a TYPE_CHECKING import (allowed):", describe(c, g))
