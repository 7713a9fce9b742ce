"""Scopes and name bindings of one module, for resolving what a name means.

One pass over the syntax tree (`binder.build_scopes`) records, per scope (module, class, function),
every binding of every name: assignments (with tuple-unpacking positions),
imports, definitions, parameters and other opaque bindings (loop targets,
`with ... as`, `except ... as`). `self.x = ...` inside a method is recorded
on the class. Lookups follow Python's rules closely enough for gates: the
innermost scope that binds the name wins (class scopes are skipped from
nested functions); within the use's own scope the bindings before the use
are the candidates, from an enclosing scope all of them.
"""

from __future__ import annotations

import ast
import bisect
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

Pos = tuple[int, int]
FunctionNode = ast.FunctionDef | ast.AsyncFunctionDef


@dataclass(eq=False)
class Binding:
    name: str
    pos: Pos  # where the bound value becomes visible
    kind: str  # value, import, module, def, param, opaque
    node: ast.AST | None = None  # value expression, or the definition
    index: tuple[int, ...] = ()  # position inside an unpacked tuple
    scope: Scope | None = None  # where `node` is evaluated
    target: str = ""  # import: dotted module; for from-imports "module:name"


@dataclass(eq=False)
class Scope:
    kind: str  # module, class, function
    qualname: str  # <module>, Class, Class.method, outer.inner
    parent: Scope | None
    node: ast.AST
    names: dict[str, list[Binding]] = field(default_factory=dict)
    attrs: dict[str, list[Binding]] = field(default_factory=dict)  # class: self.X
    self_name: str | None = None  # function: the method's first parameter
    owner: Scope | None = None  # function: the class it is a method of (or its method's)

    def bind(self, binding: Binding) -> None:
        self.names.setdefault(binding.name, []).append(binding)


@dataclass(eq=False)
class ModuleScopes:
    module: str  # dotted module name
    package: str  # package for relative imports
    root: Scope
    of_node: dict[int, Scope]  # id(FunctionDef / ClassDef node) -> its scope
    _calls: dict[str, list[tuple[ast.Call, Scope]]] | None = None
    rebound: set[str] = field(default_factory=set)  # names some function declares `global`
    _calls_of: dict[str, list[tuple[ast.Call, Scope]]] = field(default_factory=dict)
    _classes: dict[str, Scope] | None = None
    memo: dict[str, Any] = field(default_factory=dict)  # derived facts, the same on every arch

    def lookup(self, name: str, scope: Scope, pos: Pos) -> list[Binding]:
        """Candidate bindings of `name` used at `pos` in `scope`, best first.

        In the use's own scope: the last binding before the use (flow order,
        approximately). From an enclosing scope: all of them, last first (a
        function reads a module flag after the whole module ran; the caller
        prefers the one derived from the architecture).
        """
        current: Scope | None = scope
        nested = False
        while current is not None:
            if current.kind == "class" and nested:
                current = current.parent
                continue
            bindings = current.names.get(name)
            if bindings:
                if not nested:
                    before = [b for b in bindings if b.pos <= pos]
                    if before:
                        return before[-1:]
                return bindings[::-1]
            nested = True
            current = current.parent
        return []

    def self_attr(self, scope: Scope, attr: str) -> list[Binding]:
        """Bindings of `self.attr` / `cls.attr` for a method's own class."""
        owner = scope.owner
        if owner is None:
            return []
        return (owner.attrs.get(attr, []) + owner.names.get(attr, []))[::-1]

    def calls_to(
        self, name: str, lines: Iterable[int] | None = None
    ) -> list[tuple[ast.Call, Scope]]:
        """Every call of a function or method named `name` in the module.

        `lines`: every line where the name occurs (if known): only the
        statements there are looked at. The answer is cached per name.
        """
        if lines is not None:
            cached = self._calls_of.get(name)
            if cached is None:
                cached = self._calls_of[name] = [
                    (node, scope)
                    for line in sorted(lines)
                    for node, scope in self.calls_on_line(line)
                    if _callee(node) == name
                ]
            return cached
        if self._calls is None:
            self._calls = {}
            for scope in (self.root, *self.of_node.values()):
                for node in _own_nodes(scope.node):
                    if isinstance(node, ast.Call):
                        callee = _callee(node)
                        if callee:
                            self._calls.setdefault(callee, []).append((node, scope))
        return self._calls.get(name, [])

    def calls_on_line(self, line: int) -> list[tuple[ast.Call, Scope]]:
        """The calls starting on `line`, found by descending to the statement there."""
        return [(call, scope) for call, scope in self.statement_calls(line) if call.lineno == line]

    def statement_calls(self, line: int) -> list[tuple[ast.Call, Scope]]:
        """The calls of the innermost statement spanning `line` (not of statements nested in it)."""
        scope = self.root
        body: list[ast.stmt] = self.root.node.body  # type: ignore[attr-defined]
        while True:
            stmt = _statement_at(body, line)
            if stmt is None:
                return []
            inner = [b for b in _bodies(stmt) if _statement_at(b, line) is not None]
            if not inner:
                break
            if isinstance(stmt, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                scope = self.of_node.get(id(stmt), scope)
            body = inner[0]
        return [(node, scope) for node in _header_nodes(stmt) if isinstance(node, ast.Call)]

    def classes(self) -> dict[str, Scope]:
        """Every class of the module by qualified name."""
        if self._classes is None:
            self._classes = {s.qualname: s for s in self.of_node.values() if s.kind == "class"}
        return self._classes

    def imports(self) -> list[Binding]:
        """Every import binding of the module, in any scope."""
        found: list[Binding] = []
        for scope in (self.root, *self.of_node.values()):
            for bindings in scope.names.values():
                found.extend(b for b in bindings if b.kind in ("import", "module"))
        return found

    def dispose(self) -> None:
        """Break the reference cycles (scope <-> binding) so memory frees at once."""
        for scope in (self.root, *self.of_node.values()):
            scope.names.clear()
            scope.attrs.clear()
            scope.parent = scope.owner = None
        self.of_node.clear()
        self._calls = None
        self._calls_of.clear()
        self._classes = None
        self.memo.clear()


def argument_for(fn: FunctionNode, binding: Binding, call: ast.Call) -> ast.expr | None:
    """The expression `call` passes for parameter `binding` of `fn` (None: not known).

    Called as `obj.fn(...)` a method gets `self` from the attribute access.
    """
    for keyword in call.keywords:
        if keyword.arg == binding.name:
            return keyword.value
    args = fn.args
    position = binding.index[0]
    if position >= len(args.posonlyargs) + len(args.args):
        return None  # *args, keyword-only or **kwargs
    method = binding.scope is not None and binding.scope.owner is not None
    if method and isinstance(call.func, ast.Attribute):
        position -= 1
    if any(isinstance(a, ast.Starred) for a in call.args):
        return None
    return call.args[position] if 0 <= position < len(call.args) else None


def _statement_at(body: list[ast.stmt], line: int) -> ast.stmt | None:
    starts = [stmt.lineno for stmt in body]
    i = bisect.bisect_right(starts, line) - 1
    if i >= 0 and line <= (body[i].end_lineno or body[i].lineno):
        return body[i]
    return None


def _bodies(stmt: ast.stmt) -> list[list[ast.stmt]]:
    """The statement lists nested in a compound statement."""
    bodies = [getattr(stmt, name, None) for name in ("body", "orelse", "finalbody")]
    found = [b for b in bodies if isinstance(b, list) and b and isinstance(b[0], ast.stmt)]
    for handler in getattr(stmt, "handlers", ()):
        found.append(handler.body)
    for case in getattr(stmt, "cases", ()):
        found.append(case.body)
    return found


def _header_nodes(stmt: ast.stmt) -> list[ast.AST]:
    """A statement's own expressions: not the statements nested in it."""
    nested = {id(s) for body in _bodies(stmt) for s in body}
    found: list[ast.AST] = []
    stack = [c for c in ast.iter_child_nodes(stmt) if id(c) not in nested]
    while stack:
        node = stack.pop()
        if isinstance(node, ast.stmt | ast.ExceptHandler | ast.match_case):
            continue
        found.append(node)
        stack.extend(ast.iter_child_nodes(node))
    return found


def _callee(call: ast.Call) -> str | None:
    func = call.func
    if isinstance(func, ast.Name):
        return func.id
    return func.attr if isinstance(func, ast.Attribute) else None


def _own_nodes(root: ast.AST) -> list[ast.AST]:
    """The nodes of a scope's own code: not inside nested functions or classes."""
    found: list[ast.AST] = []
    stack = list(ast.iter_child_nodes(root))
    while stack:
        node = stack.pop()
        found.append(node)
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            # decorators and defaults run in this scope; the body does not
            stack.extend(node.decorator_list)
            if not isinstance(node, ast.ClassDef):
                stack.extend(d for d in (*node.args.defaults, *node.args.kw_defaults) if d)
            continue
        stack.extend(ast.iter_child_nodes(node))
    return found


def module_name(relpath: str) -> tuple[str, str]:
    """('sglang.srt.x', package) for 'python/sglang/srt/x.py' (or 'sglang/srt/x.py')."""
    parts = relpath[:-3].split("/") if relpath.endswith(".py") else relpath.split("/")
    if parts and parts[0] == "python":
        parts = parts[1:]
    if parts and parts[-1] == "__init__":
        parts = parts[:-1]
        return ".".join(parts), ".".join(parts)
    return ".".join(parts), ".".join(parts[:-1])
