"""The tool's layout (issue 17): no import cycle among sm120fork's modules, not
even through imports made only for type checking, and few top-level modules."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "scripts" / "sm120fork"
TOP_LEVEL_LIMIT = 12


def _modules() -> dict[str, Path]:
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = ["sm120fork", *path.relative_to(PACKAGE).with_suffix("").parts]
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


def _type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports(module: str, path: Path, modules: dict[str, Path]) -> list[tuple[str, bool]]:
    """(imported module of the package, only under TYPE_CHECKING) for every import."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found: list[tuple[str, bool]] = []

    def visit(nodes: list[ast.stmt], typing_only: bool) -> None:
        for node in nodes:
            if isinstance(node, ast.If) and _type_checking(node):
                visit(node.body, True)
                visit(node.orelse, typing_only)
            elif isinstance(node, ast.Import):
                found.extend((alias.name, typing_only) for alias in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join([*up, *([node.module] if node.module else [])])
                for alias in node.names:
                    name = f"{base}.{alias.name}"
                    found.append((name if name in modules else base, typing_only))
            else:
                for field in ("body", "orelse", "finalbody", "handlers"):
                    inner = getattr(node, field, None)
                    if isinstance(inner, list):
                        visit([n for n in inner if isinstance(n, ast.stmt)], typing_only)
                for handler in getattr(node, "handlers", ()):
                    visit(handler.body, typing_only)

    visit(ast.parse(path.read_text(encoding="utf-8")).body, False)
    edges = []
    for name, typing_only in found:
        parts = name.split(".")
        for i in range(2, len(parts) + 1):  # importing a.b.c runs a.b first
            target = ".".join(parts[:i])
            if target in modules and target != module and not module.startswith(target + "."):
                edges.append((target, typing_only))
    return edges


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles = []

    def strong(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for nxt in sorted(graph[node]):
            if nxt not in index:
                strong(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            strong(node)
    return cycles


def test_no_import_cycle() -> None:
    modules = _modules()
    edges = {m: _imports(m, path, modules) for m, path in modules.items()}
    runtime = {m: {t for t, typing_only in e if not typing_only} for m, e in edges.items()}
    everything = {m: {t for t, _ in e} for m, e in edges.items()}
    assert _cycles(runtime) == []
    assert _cycles(everything) == [], "a cycle through imports under TYPE_CHECKING"


def test_cycle_check_sees_a_cycle() -> None:
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_few_top_level_modules() -> None:
    top = sorted(p.name for p in PACKAGE.glob("*.py"))
    assert len(top) <= TOP_LEVEL_LIMIT, top
