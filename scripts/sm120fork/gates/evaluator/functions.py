"""What a zero-argument function of the module returns, on one architecture.

`_compute_enable_deep_gemm()` returns False when `get_device_sm() < 90`, and
otherwise whatever an import and an environment variable say: the body is
run path by path (if/else, try/except, with), following the branches whose
test is known and both branches of an unknown one; the results of all paths
are joined into one value (known when every path agrees). Loops that return
and anything else unusual make the result unknown.
"""

from __future__ import annotations

import ast

from sm120fork.gates.evaluator.base import EvaluatorBase
from sm120fork.gates.scopes import Scope
from sm120fork.gates.values import Dep, LocalFn, Val, concrete, truth, unknown


def zero_argument(fn: LocalFn) -> bool:
    """Can it be called with no arguments (self/cls supplied when bound)?"""
    args = fn.node.args
    positional = [*args.posonlyargs, *args.args]
    if fn.bound and positional:
        positional = positional[1:]
    required = len(positional) - len(args.defaults)
    kw_required = sum(1 for d in args.kw_defaults if d is None)
    return required <= 0 and kw_required == 0


class _Run:
    """One function's paths on one architecture."""

    def __init__(self, evaluator: EvaluatorBase, scope: Scope) -> None:
        self.evaluator = evaluator
        self.scope = scope
        self.results: list[tuple[Val, frozenset[Dep]]] = []
        self.arch_path = False  # an architecture test decided where control went

    def block(self, body: list[ast.stmt], path: frozenset[Dep]) -> tuple[bool, frozenset[Dep]]:
        """Run statements; (can fall through, dependencies of the path so far)."""
        for stmt in body:
            falls, path = self.stmt(stmt, path)
            if not falls:
                return False, path
        return True, path

    def stmt(self, stmt: ast.stmt, path: frozenset[Dep]) -> tuple[bool, frozenset[Dep]]:
        if isinstance(stmt, ast.Return):
            val = self.eval(stmt.value) if stmt.value is not None else Val(None, fact=True)
            if self.arch_path and not val.arch:
                val = Val(val.value, val.deps, True, val.test, val.fact)
            self.results.append((val, path))
            return False, path
        if isinstance(stmt, ast.Raise):
            return False, path
        if isinstance(stmt, ast.If):
            return self.branch(stmt, path)
        if isinstance(stmt, ast.Try | ast.TryStar):
            return self.try_(stmt, path)
        if isinstance(stmt, ast.With | ast.AsyncWith):
            return self.block(stmt.body, path)
        if isinstance(stmt, ast.For | ast.AsyncFor | ast.While):
            if any(isinstance(n, ast.Return) for n in ast.walk(stmt)):
                self.results.append((unknown((stmt,)), path))
            return True, path
        return True, path

    def branch(self, stmt: ast.If, path: frozenset[Dep]) -> tuple[bool, frozenset[Dep]]:
        test = self.eval(stmt.test)
        if test.arch and not self.arch_path:
            self.arch_path = any(
                isinstance(node, ast.Return | ast.Raise) for node in ast.walk(stmt)
            )
        answer = truth(test)
        if answer is True:
            return self.block(stmt.body, path)
        if answer is False:
            return self.block(stmt.orelse, path)
        path = path | (test.deps or frozenset((stmt.test,)))
        body_falls, _ = self.block(stmt.body, path)
        else_falls, _ = self.block(stmt.orelse, path)
        return body_falls or else_falls, path

    def try_(
        self, stmt: ast.Try | ast.TryStar, path: frozenset[Dep]
    ) -> tuple[bool, frozenset[Dep]]:
        falls, after = self.block(stmt.body, path)
        if falls:
            falls, after = self.block(stmt.orelse, after)
        imports = [
            node
            for node in ast.walk(ast.Module(body=stmt.body, type_ignores=[]))
            if isinstance(node, ast.Import | ast.ImportFrom)
        ]
        failure: Dep = (
            "import " + ", ".join(ast.unparse(i).split("import ", 1)[-1] for i in imports)
            if imports
            else "an exception in " + self.scope.qualname
        )
        for handler in stmt.handlers:
            handler_falls, _ = self.block(handler.body, path | {failure})
            falls = falls or handler_falls
        if falls and stmt.handlers:
            after = after | {failure}
        if stmt.finalbody:
            final_falls, after = self.block(stmt.finalbody, after)
            falls = falls and final_falls
        return falls, after

    def eval(self, node: ast.expr) -> Val:
        return self.evaluator.eval(node, self.scope)

    def join(self) -> Val:
        vals = [v for v, _ in self.results]
        arch = self.arch_path or any(v.arch for v in vals)
        # A yes/no answer: some path answers a boolean, none answers anything else.
        answers = [v.test or (concrete(v) and isinstance(v.value, bool)) for v in vals]
        test = (
            arch
            and any(answers)
            and all(a or not v.known for a, v in zip(answers, vals, strict=True))
        )
        if vals and all(concrete(v) for v in vals):
            first = vals[0].value
            if all(type(v.value) is type(first) and v.value == first for v in vals):
                fact = arch or all(v.fact for v in vals)
                return Val(first, arch=arch, test=test, fact=fact)
        deps: set[Dep] = set()
        for val, path in self.results:
            deps |= val.deps | path
        if not deps:
            deps.add(self.scope.qualname + "()")
        return unknown(deps, arch=arch, test=test)


class Summaries:
    def __init__(self, evaluator: EvaluatorBase) -> None:
        self.evaluator = evaluator
        self.memo: dict[int, Val] = {}
        self.active: set[int] = set()

    def call(self, fn: LocalFn, call: ast.Call) -> Val:
        if not zero_argument(fn):
            return unknown((call,))
        key = id(fn.node)
        cached = self.memo.get(key)
        if cached is not None:
            return cached
        if key in self.active:  # recursion
            return unknown((call,))
        scope = self.evaluator.scopes.of_node.get(key)
        if scope is None:
            return unknown((call,))
        self.active.add(key)
        try:
            run = _Run(self.evaluator, scope)
            falls, path = run.block(fn.node.body, frozenset())
            if falls:
                run.results.append((Val(None, fact=True), path))
            val = run.join()
        finally:
            self.active.discard(key)
        if not val.arch:  # nothing architectural: the call stays opaque
            val = unknown((call,))
        self.memo[key] = val
        return val
