"""Find the gate sites of one module.

A site is a condition that tests the architecture: the test of an `if`,
`elif`, `while`, ternary, `assert` or comprehension, a returned or assigned
boolean architecture test (`_is_sm100 = is_sm100_supported()`, a module flag
when at module level), or any other boolean architecture test inside an
expression (`foo(use_fp8=is_blackwell())`). The whole condition is the site:
nothing inside a site is reported again.
"""

from __future__ import annotations

import ast
import bisect
from dataclasses import dataclass

from sm120fork.gates.evaluator import Evaluator
from sm120fork.gates.model import Guarded
from sm120fork.gates.scopes import ModuleScopes, Scope

_TEXT_LIMIT = 2000


@dataclass(frozen=True)
class Site:
    node: ast.expr  # the condition
    scope: Scope
    kind: str
    guarded: Guarded
    within: str | None  # the test of the innermost enclosing `if` in the function


def words(*nodes: ast.AST | None) -> tuple[str, ...]:
    """Lower-cased identifiers and short string literals under `nodes`."""
    found: list[str] = []
    for root in nodes:
        if root is None:
            continue
        for node in ast.walk(root):
            if isinstance(node, ast.Name):
                found.append(node.id.lower())
            elif isinstance(node, ast.Attribute):
                found.append(node.attr.lower())
            elif isinstance(node, ast.Constant) and isinstance(node.value, str):
                if len(node.value) <= 200:
                    found.append(node.value.lower())
            elif isinstance(node, ast.keyword) and node.arg:
                found.append(node.arg.lower())
            elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                found.append(node.name.lower())
    return tuple(dict.fromkeys(found))


def _text(*nodes: ast.AST) -> str:
    return " / ".join(ast.unparse(n) for n in nodes)[:_TEXT_LIMIT]


def _block(body: list[ast.stmt]) -> ast.Module:
    return ast.Module(body=body, type_ignores=[])


def _header(scope: Scope) -> str:
    """The enclosing function's name and decorators (`@register("Model")`)."""
    node = scope.node
    decorators = getattr(node, "decorator_list", [])
    return " ".join([scope.qualname, *(ast.unparse(d) for d in decorators)])


def rejects(body: list[ast.stmt]) -> bool:
    """Does the branch only refuse (raise), perhaps after logging?"""
    raises = False
    for stmt in body:
        if isinstance(stmt, ast.Raise):
            raises = True
        elif not isinstance(stmt, ast.Expr | ast.Pass):
            return False
    return raises


class SiteFinder:
    def __init__(self, scopes: ModuleScopes, evaluator: Evaluator, hot: frozenset[int]) -> None:
        self.scopes = scopes
        self.ev = evaluator
        self.hot = hot
        self.hot_sorted = sorted(hot)
        self.sites: list[Site] = []
        self.within: ast.If | None = None  # the enclosing `if` of the current statement

    def run(self) -> list[Site]:
        self.block(self.scopes.root.node.body, self.scopes.root, None)  # type: ignore[attr-defined]
        return self.sites

    def is_hot(self, node: ast.AST) -> bool:
        start = getattr(node, "lineno", 0)
        if start in self.hot:
            return True
        end = getattr(node, "end_lineno", start) or start
        if end == start:
            return False
        i = bisect.bisect_left(self.hot_sorted, start)
        return i < len(self.hot_sorted) and self.hot_sorted[i] <= end

    def arch(self, node: ast.AST, scope: Scope) -> bool:
        return self.is_hot(node) and self.ev.eval(node, scope).arch

    def add(self, node: ast.expr, scope: Scope, kind: str, guarded: Guarded) -> None:
        within = ast.unparse(self.within.test) if self.within is not None else None
        self.sites.append(Site(node, scope, kind, guarded, within))

    # -- statements -------------------------------------------------------------

    def block(self, body: list[ast.stmt], scope: Scope, enclosing: ast.If | None) -> None:
        for stmt in body:
            self.stmt(stmt, scope, enclosing)

    def stmt(
        self, stmt: ast.stmt, scope: Scope, enclosing: ast.If | None, elif_: bool = False
    ) -> None:
        self.within = enclosing
        if isinstance(stmt, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            header = [*stmt.decorator_list]
            if isinstance(stmt, ast.ClassDef):
                header += [*stmt.bases, *(k.value for k in stmt.keywords)]
            else:
                header += [d for d in (*stmt.args.defaults, *stmt.args.kw_defaults) if d]
            for expr in header:
                self.expr(expr, scope, "expr", expr)
            inner = self.scopes.of_node[id(stmt)]
            self.block(stmt.body, inner, None)
        elif isinstance(stmt, ast.If):
            self.if_(stmt, scope, enclosing, "elif" if elif_ else "if")
        elif isinstance(stmt, ast.While):
            self.if_(stmt, scope, enclosing, "while")
        elif isinstance(stmt, ast.Assert):
            self.assert_site(stmt, scope, enclosing)
        elif isinstance(stmt, ast.Return):
            if stmt.value is not None:
                self.expr(stmt.value, scope, "return", stmt)
        elif isinstance(stmt, ast.Assign | ast.AnnAssign | ast.AugAssign):
            if stmt.value is not None:
                slot = "flag" if scope.kind == "module" else "assign"
                self.expr(stmt.value, scope, slot, stmt)
        elif isinstance(stmt, ast.For | ast.AsyncFor):
            self.expr(stmt.iter, scope, "expr", stmt)
            self.block(stmt.body, scope, enclosing)
            self.block(stmt.orelse, scope, enclosing)
        elif isinstance(stmt, ast.With | ast.AsyncWith):
            for item in stmt.items:
                self.expr(item.context_expr, scope, "expr", stmt)
            self.block(stmt.body, scope, enclosing)
        elif isinstance(stmt, ast.Try | ast.TryStar):
            self.block(stmt.body, scope, enclosing)
            for handler in stmt.handlers:
                self.block(handler.body, scope, enclosing)
            self.block(stmt.orelse, scope, enclosing)
            self.block(stmt.finalbody, scope, enclosing)
        elif isinstance(stmt, ast.Match):
            self.expr(stmt.subject, scope, "expr", stmt)
            for case in stmt.cases:
                if case.guard is not None and self.arch(case.guard, scope):
                    guarded = Guarded(
                        words(_block(case.body)), None, rejects(case.body), _text(_block(case.body))
                    )
                    self.add(case.guard, scope, "if", guarded)
                self.block(case.body, scope, enclosing)
        elif isinstance(stmt, ast.Expr | ast.Raise | ast.Delete):
            for child in ast.iter_child_nodes(stmt):
                if isinstance(child, ast.expr):
                    self.expr(child, scope, "expr", stmt)

    def if_(
        self, stmt: ast.If | ast.While, scope: Scope, enclosing: ast.If | None, kind: str
    ) -> None:
        if self.arch(stmt.test, scope):
            self.add(stmt.test, scope, kind, self._if_guarded(stmt, scope, enclosing))
        else:
            self.expr(stmt.test, scope, "expr", stmt)
        self.block(stmt.body, scope, stmt if isinstance(stmt, ast.If) else enclosing)
        orelse = stmt.orelse
        if isinstance(stmt, ast.If) and len(orelse) == 1 and isinstance(orelse[0], ast.If):
            self.stmt(orelse[0], scope, enclosing, elif_=True)
        else:
            self.block(orelse, scope, enclosing)

    def _if_guarded(
        self, stmt: ast.If | ast.While, scope: Scope, enclosing: ast.If | None
    ) -> Guarded:
        body, orelse = stmt.body, stmt.orelse
        refuses = rejects(body)
        taken_false: tuple[str, ...] | None
        if len(orelse) == 1 and isinstance(orelse[0], ast.If):
            taken_false = None  # an elif: its own gate
        elif orelse:
            taken_false = words(_block(orelse))
        elif refuses:  # a guard clause: what passes it is what the code around selects
            taken_false = self._continuation(body, scope, enclosing)
        else:
            taken_false = ()
        surroundings = self._continuation([], scope, enclosing) if refuses else ()
        # For comparing releases: the enclosing test names the case (the model
        # architecture, the backend) that the gate's own code is about.
        context: list[ast.AST] = [enclosing.test] if enclosing is not None else []
        header = _header(scope)
        text = (header + " / " + _text(*context, _block(body)))[:_TEXT_LIMIT]
        return Guarded(words(_block(body)), taken_false, refuses, text, surroundings)

    def _continuation(
        self, body: list[ast.stmt], scope: Scope, enclosing: ast.If | None
    ) -> tuple[str, ...]:
        context = [enclosing.test if enclosing is not None else None, *body]
        found = words(*context)
        if scope.kind == "function":
            found += (scope.qualname.rsplit(".", 1)[-1].lower(),)
        return found

    def assert_site(self, stmt: ast.Assert, scope: Scope, enclosing: ast.If | None) -> None:
        if not self.arch(stmt.test, scope):
            return
        context = [enclosing.test if enclosing is not None else None, stmt.msg]
        taken = words(*context)
        if scope.kind == "function":
            taken += (scope.qualname.rsplit(".", 1)[-1].lower(),)
        text = _text(stmt.msg) if stmt.msg is not None else ""
        self.add(stmt.test, scope, "assert", Guarded(taken, None, False, text))

    # -- expressions ------------------------------------------------------------

    def expr(self, node: ast.expr, scope: Scope, slot: str, stmt: ast.AST) -> None:
        if not self.is_hot(node):
            return
        val = self.ev.eval(node, scope)
        if slot in ("return", "flag", "assign") and val.arch and val.test:
            self.add(node, scope, slot, self._slot_guarded(slot, scope, stmt))
            return
        self.descend(node, scope, stmt)

    def _slot_guarded(self, slot: str, scope: Scope, stmt: ast.AST) -> Guarded:
        if isinstance(stmt, ast.Assign):
            targets: list[ast.AST] = list(stmt.targets)
        elif isinstance(stmt, ast.AnnAssign | ast.AugAssign):
            targets = [stmt.target]
        else:
            targets = []
        taken = words(*targets)
        if slot == "return" and scope.kind == "function":
            taken += (scope.qualname.rsplit(".", 1)[-1].lower(),)
        # What such a gate guards is its name and what it computes.
        text = " / ".join(
            [_text(*targets) if targets else scope.qualname, _text(stmt) if stmt else ""]
        )[:_TEXT_LIMIT]
        return Guarded(taken, None, False, text)

    def descend(self, node: ast.AST, scope: Scope, stmt: ast.AST) -> None:
        if isinstance(node, ast.IfExp):
            if self.arch(node.test, scope):
                guarded = Guarded(
                    words(node.body), words(node.orelse), False, _text(node.body, node.orelse)
                )
                self.add(node.test, scope, "ternary", guarded)
            for branch in (node.body, node.orelse):
                if self.is_hot(branch):
                    self.descend(branch, scope, stmt)
            return
        if isinstance(node, ast.ListComp | ast.SetComp | ast.GeneratorExp | ast.DictComp):
            element = node.elt if not isinstance(node, ast.DictComp) else node.value
            for generator in node.generators:
                for cond in generator.ifs:
                    if self.arch(cond, scope):
                        self.add(
                            cond,
                            scope,
                            "comprehension",
                            Guarded(words(element), None, False, _text(element)),
                        )
            if self.is_hot(element):
                self.descend(element, scope, stmt)
            return
        if isinstance(node, ast.BoolOp | ast.Compare | ast.UnaryOp | ast.Call):
            val = self.ev.eval(node, scope)
            if val.arch and val.test:
                self.add(node, scope, "expr", Guarded(words(stmt), None, False, _text(stmt)))
                return
        for child in ast.iter_child_nodes(node):
            target = child.value if isinstance(child, ast.keyword) else child
            if isinstance(target, ast.expr) and self.is_hot(target):
                self.descend(target, scope, stmt)
