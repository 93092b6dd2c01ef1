"""The package's import graph has no circles: value types live in leaf modules, and a module never
imports (at top level or inside a function) one that imports it back. Walks every module's imports
with `ast`, so a new circle fails here with the modules that form it."""

from __future__ import annotations

import ast
from pathlib import Path

import mint_server

ROOT = Path(mint_server.__file__).parent


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def parse(path: Path) -> ast.Module:
    # CPython 3.11 keeps the AST builder's recursion depth per interpreter, not per thread (gh-106905): a
    # traceback formatted on another thread meanwhile (3.11 parses source lines for its carets; the
    # SDK clients of earlier tests log failed telemetry from background threads) can make a parse
    # here raise SystemError "AST constructor recursion depth mismatch" (seen in CI). The file is
    # fine then, so it is parsed again (the last try's error, if any, is the test's).
    source = path.read_text()
    for _ in range(4):
        try:
            return ast.parse(source, str(path))
        except SystemError:
            pass
    return ast.parse(source, str(path))


def import_graph() -> dict[str, set[str]]:
    modules = {_module_name(p): p for p in ROOT.rglob("*.py") if "migrations" not in p.parts}
    graph: dict[str, set[str]] = {m: set() for m in modules}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(parse(path)):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                    base = f"{anchor}.{base}" if base else anchor
                # `from pkg import mod` names a module; `from mod import name` names the module
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
            else:
                continue
            for target in targets:
                while target and target not in modules:  # `import a.b.c` → the deepest module we have
                    target = target.rpartition(".")[0]
                # A package's __init__ is not an edge to its own modules' users: skip self and parents.
                if target and target != name and not name.startswith(target + "."):
                    graph[name].add(target)
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_the_walker_sees_a_circle() -> None:
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_import_circles() -> None:
    graph = import_graph()
    assert "mint_server.engine.interface" in graph["mint_server.api.core"]  # the walker reads real imports
    assert circles(graph) == []


def test_the_api_knows_the_engine_only_through_its_interface() -> None:
    graph = import_graph()
    reached = {t for m, targets in graph.items() if m.startswith("mint_server.api") for t in targets
               if t.startswith("mint_server.engine")}  # fmt: skip
    assert reached == {"mint_server.engine.interface"}
