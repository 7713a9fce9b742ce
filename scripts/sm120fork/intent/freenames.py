"""Names an intent's new code uses that the place it lands does not have.

An intent is written against one release's code; when upstream changes the code's
shape (ServerArgs' `self.x = ...` became a pass returning `overrides`), a recipe can
still find its anchor and would write code that cannot run. Such an edit does not
fit: every name the new code reads must be bound by the module, an enclosing
function, the intent's own edits, or be a builtin.
"""

from __future__ import annotations

import ast
import builtins
import textwrap

_BUILTINS = set(dir(builtins)) | {"__file__", "__name__"}


def stored(tree: ast.AST) -> set[str]:
    """Every name `tree` binds (assignments, defs, imports, parameters, handlers)."""
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store | ast.Del):
            names.add(node.id)
        elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.add(node.name)
        elif isinstance(node, ast.arg):
            names.add(node.arg)
        elif isinstance(node, ast.alias):
            names.add((node.asname or node.name).split(".")[0])
        elif isinstance(node, ast.ExceptHandler) and node.name:
            names.add(node.name)
        elif isinstance(node, ast.Global | ast.Nonlocal):
            names.update(node.names)
    return names


def _module_level(tree: ast.Module) -> set[str]:
    """Names bound at module level (a def or class by its name only)."""
    names: set[str] = set()
    for node in tree.body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.add(node.name)
        else:
            names |= stored(node)
    return names


def first_line(node: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    """Where a function starts, its decorators included (libcst's span starts there)."""
    return min([node.lineno, *(d.lineno for d in node.decorator_list)])


def unbound(module: ast.Module, line: int, code: str, introduced: set[str]) -> list[str]:
    """Names `code`, landing at `line` of `module`, reads that nothing there binds."""
    text = textwrap.dedent(code).strip("\n")
    text = f"if{text[4:]}" if text.startswith("elif") else text  # a new branch alone
    try:
        new: ast.AST = ast.parse(text)
    except SyntaxError:
        try:
            new = ast.parse(f"(\n{text}\n)", mode="eval")
        except SyntaxError:
            return []
    if any(isinstance(n, ast.ImportFrom) and n.names[0].name == "*" for n in module.body):
        return []  # a star import binds names no one can list
    bound = _module_level(module) | introduced | stored(new) | _BUILTINS
    for node in ast.walk(module):
        if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            continue
        if first_line(node) <= line <= (node.end_lineno or node.lineno):
            bound |= stored(node)
    read = {n.id for n in ast.walk(new) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)}
    return sorted(read - bound)
