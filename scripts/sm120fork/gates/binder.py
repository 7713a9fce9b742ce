"""Build a module's scopes: one pass over the syntax tree that records every
binding of every name in the scope it belongs to (see `scopes` for the rules
lookups follow).
"""

from __future__ import annotations

import ast

from sm120fork.gates.scopes import Binding, FunctionNode, ModuleScopes, Pos, Scope, module_name


def build_scopes(tree: ast.Module, relpath: str, *, walrus: bool = True) -> ModuleScopes:
    """`walrus=False`: the source has no `:=`, skip looking for assignment expressions."""
    module, package = module_name(relpath)
    root = Scope("module", "<module>", None, tree)
    scopes = ModuleScopes(module, package, root, {})
    _Builder(scopes, walrus).block(tree.body, root)
    return scopes


def _end(node: ast.AST) -> Pos:
    return (getattr(node, "end_lineno", 0) or 0, getattr(node, "end_col_offset", 0) or 0)


def _start(node: ast.AST) -> Pos:
    return (getattr(node, "lineno", 0), getattr(node, "col_offset", 0))


class _Builder:
    def __init__(self, scopes: ModuleScopes, walrus: bool) -> None:
        self.scopes = scopes
        self.has_walrus = walrus

    def block(self, body: list[ast.stmt], scope: Scope) -> None:
        for stmt in body:
            self.stmt(stmt, scope)

    def stmt(self, stmt: ast.stmt, scope: Scope) -> None:
        if isinstance(stmt, ast.FunctionDef | ast.AsyncFunctionDef):
            scope.bind(Binding(stmt.name, _start(stmt), "def", stmt, scope=scope))
            self.function(stmt, scope)
        elif isinstance(stmt, ast.ClassDef):
            scope.bind(Binding(stmt.name, _start(stmt), "def", stmt, scope=scope))
            qual = stmt.name if scope.kind == "module" else f"{scope.qualname}.{stmt.name}"
            inner = Scope("class", qual, scope, stmt)
            self.scopes.of_node[id(stmt)] = inner
            self.block(stmt.body, inner)
        elif isinstance(stmt, ast.Assign):
            for target in stmt.targets:
                self.target(target, stmt.value, (), stmt, scope)
        elif isinstance(stmt, ast.AnnAssign):
            if stmt.value is not None:
                self.target(stmt.target, stmt.value, (), stmt, scope)
        elif isinstance(stmt, ast.AugAssign):
            self.target(stmt.target, None, (), stmt, scope)
        elif isinstance(stmt, ast.Import | ast.ImportFrom):
            self.imports(stmt, scope)
        elif isinstance(stmt, ast.For | ast.AsyncFor):
            self.target(stmt.target, None, (), stmt.target, scope)
            self.block(stmt.body, scope)
            self.block(stmt.orelse, scope)
        elif isinstance(stmt, ast.If | ast.While):
            if self.has_walrus:
                self.walrus(stmt.test, scope)
            self.block(stmt.body, scope)
            self.block(stmt.orelse, scope)
        elif isinstance(stmt, ast.With | ast.AsyncWith):
            for item in stmt.items:
                if item.optional_vars is not None:
                    self.target(item.optional_vars, None, (), stmt, scope)
            self.block(stmt.body, scope)
        elif isinstance(stmt, ast.Try | ast.TryStar):
            self.block(stmt.body, scope)
            for handler in stmt.handlers:
                if handler.name:
                    scope.bind(Binding(handler.name, _start(handler), "opaque", scope=scope))
                self.block(handler.body, scope)
            self.block(stmt.orelse, scope)
            self.block(stmt.finalbody, scope)
        elif isinstance(stmt, ast.Match):
            for case in stmt.cases:
                self.block(case.body, scope)
        elif isinstance(stmt, ast.Global):
            self.scopes.rebound.update(stmt.names)

    def function(self, node: FunctionNode, scope: Scope) -> None:
        qual = node.name if scope.kind == "module" else f"{scope.qualname}.{node.name}"
        inner = Scope("function", qual, scope, node)
        self.scopes.of_node[id(node)] = inner
        args = node.args
        params = [*args.posonlyargs, *args.args, *args.kwonlyargs]
        if args.vararg:
            params.append(args.vararg)
        if args.kwarg:
            params.append(args.kwarg)
        for position, param in enumerate(params):
            # A parameter's value comes from the calls: see Evaluator.param_value.
            inner.bind(Binding(param.arg, _start(node), "param", node, (position,), inner))
        if scope.kind == "class":
            inner.owner = scope
            positional = [*args.posonlyargs, *args.args]
            is_static = any(
                isinstance(d, ast.Name) and d.id == "staticmethod" for d in node.decorator_list
            )
            if positional and not is_static:
                inner.self_name = positional[0].arg
        elif scope.kind == "function":  # a closure inside a method sees its self
            inner.owner, inner.self_name = scope.owner, scope.self_name
        self.block(node.body, inner)

    def target(
        self,
        target: ast.expr,
        value: ast.expr | None,
        index: tuple[int, ...],
        stmt: ast.AST,
        scope: Scope,
    ) -> None:
        if isinstance(target, ast.Name):
            kind = "value" if value is not None else "opaque"
            scope.bind(Binding(target.id, _end(stmt), kind, value, index, scope))
        elif isinstance(target, ast.Tuple | ast.List):
            for i, element in enumerate(target.elts):
                if isinstance(element, ast.Starred):
                    self.target(element.value, None, (), stmt, scope)
                else:
                    self.target(element, value, (*index, i), stmt, scope)
        elif (
            isinstance(target, ast.Attribute)
            and isinstance(target.value, ast.Name)
            and scope.self_name is not None
            and target.value.id == scope.self_name
            and scope.owner is not None
        ):
            kind = "value" if value is not None else "opaque"
            binding = Binding(target.attr, _end(stmt), kind, value, index, scope)
            scope.owner.attrs.setdefault(target.attr, []).append(binding)

    def walrus(self, test: ast.expr, scope: Scope) -> None:
        for node in ast.walk(test):
            if isinstance(node, ast.NamedExpr) and isinstance(node.target, ast.Name):
                scope.bind(Binding(node.target.id, _end(node), "value", node.value, (), scope))

    def imports(self, stmt: ast.Import | ast.ImportFrom, scope: Scope) -> None:
        pos = _end(stmt)
        if isinstance(stmt, ast.Import):
            for alias in stmt.names:
                if alias.asname:
                    scope.bind(Binding(alias.asname, pos, "module", target=alias.name))
                else:
                    top = alias.name.split(".")[0]
                    scope.bind(Binding(top, pos, "module", target=top))
            return
        base = stmt.module or ""
        if stmt.level:
            package = self.scopes.package.split(".") if self.scopes.package else []
            if stmt.level > 1:
                package = package[: len(package) - (stmt.level - 1)]
            base = ".".join([*package, *([stmt.module] if stmt.module else [])])
        for alias in stmt.names:
            if alias.name == "*":
                continue
            name = alias.asname or alias.name
            scope.bind(Binding(name, pos, "import", target=f"{base}:{alias.name}"))
