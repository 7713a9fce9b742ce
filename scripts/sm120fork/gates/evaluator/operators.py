"""Evaluating operators three-valued: comparisons, `and` / `or` / `not`,
arithmetic, conditional expressions, subscripts and literals."""

from __future__ import annotations

import ast
import operator
from collections.abc import Callable
from typing import Any

from sm120fork.gates.evaluator.base import EvaluatorBase
from sm120fork.gates.evaluator.context import depof, merge
from sm120fork.gates.scopes import Scope
from sm120fork.gates.values import RAISES, Dep, Val, concrete, truth, unknown

_COMPARE: dict[type[ast.cmpop], Callable[[Any, Any], object]] = {
    ast.Eq: operator.eq,
    ast.NotEq: operator.ne,
    ast.Lt: operator.lt,
    ast.LtE: operator.le,
    ast.Gt: operator.gt,
    ast.GtE: operator.ge,
    ast.Is: operator.is_,
    ast.IsNot: operator.is_not,
    ast.In: lambda a, b: a in b,
    ast.NotIn: lambda a, b: a not in b,
}
_BINARY: dict[type[ast.operator], Callable[[object, object], object]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Div: operator.truediv,
}


class Operators(EvaluatorBase):
    def _Constant(self, node: ast.Constant, scope: Scope) -> Val:
        return Val(node.value)

    def _Compare(self, node: ast.Compare, scope: Scope) -> Val:
        operands = [node.left, *node.comparators]
        vals = [self.eval(o, scope) for o in operands]
        # `capability is not None` asks whether there is a device, not which.
        arch = any(v.arch for v in vals) and not (
            all(isinstance(op, ast.Is | ast.IsNot) for op in node.ops)
            and any(isinstance(o, ast.Constant) and o.value is None for o in operands)
        )
        deps: set[Dep] = set()
        fact = all(
            v.fact or isinstance(o, ast.Constant) for v, o in zip(vals, operands, strict=True)
        )
        for i, op in enumerate(node.ops):
            left, right = vals[i], vals[i + 1]
            if concrete(left) and concrete(right):
                try:
                    result = bool(_COMPARE[type(op)](left.value, right.value))
                except Exception:
                    deps.add(node)
                    continue
                if not result:
                    return Val(False, arch=arch, test=arch, fact=fact)
            else:
                if not concrete(left):
                    deps |= depof(left, operands[i])
                if not concrete(right):
                    deps |= depof(right, operands[i + 1])
        if deps:
            return unknown(deps, arch=arch, test=arch)
        return Val(True, arch=arch, test=arch, fact=fact)

    def _BoolOp(self, node: ast.BoolOp, scope: Scope) -> Val:
        vals = [self.eval(v, scope) for v in node.values]
        arch = any(v.arch for v in vals)
        stop = isinstance(node.op, ast.Or)  # `or` stops at a true operand, `and` at a false one
        deps: set[Dep] = set()
        for val, operand in zip(vals, node.values, strict=True):
            answer = truth(val)
            if answer is None:
                deps |= depof(val, operand)
            elif answer is stop:
                if deps:
                    return Val(stop, arch=arch, test=arch, fact=val.fact)
                return Val(val.value, arch=arch, test=arch, fact=val.fact)
        if deps:
            return unknown(deps, arch=arch, test=arch)
        last = vals[-1]
        return Val(last.value, arch=arch, test=arch, fact=all(v.fact for v in vals))

    def _UnaryOp(self, node: ast.UnaryOp, scope: Scope) -> Val:
        val = self.eval(node.operand, scope)
        if isinstance(node.op, ast.Not):
            answer = truth(val)
            if answer is None:
                return unknown(depof(val, node.operand), arch=val.arch, test=val.arch)
            return Val(not answer, arch=val.arch, test=val.arch, fact=val.fact)
        if concrete(val) and isinstance(val.value, int | float):
            number = val.value
            result = -number if isinstance(node.op, ast.USub) else number
            return Val(result, arch=val.arch, fact=val.fact)
        return unknown(depof(val, node), arch=val.arch)

    def _BinOp(self, node: ast.BinOp, scope: Scope) -> Val:
        left, right = self.eval(node.left, scope), self.eval(node.right, scope)
        arch = left.arch or right.arch
        op = _BINARY.get(type(node.op))
        if op is not None and concrete(left) and concrete(right):
            try:
                return Val(op(left.value, right.value), arch=arch, fact=left.fact and right.fact)
            except Exception:
                pass
        return unknown((node,), arch=arch)

    def _IfExp(self, node: ast.IfExp, scope: Scope) -> Val:
        test = self.eval(node.test, scope)
        body, orelse = self.eval(node.body, scope), self.eval(node.orelse, scope)
        arch = test.arch or body.arch or orelse.arch
        answer = truth(test)
        if answer is True:
            return merge(body, arch=arch)
        if answer is False:
            return merge(orelse, arch=arch)
        if concrete(body) and concrete(orelse) and body.value == orelse.value:
            return merge(body, arch=arch)
        return unknown(depof(test, node.test), arch=arch, test=body.test and orelse.test)

    def _Subscript(self, node: ast.Subscript, scope: Scope) -> Val:
        base = self.eval(node.value, scope)
        index = self.eval(node.slice, scope)
        return self._item(base, index, node)

    def _item(self, base: Val, index: Val, node: ast.AST) -> Val:
        arch = base.arch or index.arch
        if concrete(base) and concrete(index):
            try:
                value = base.value[index.value]  # type: ignore[index]
            except Exception as error:  # a table without this architecture: it crashes
                text = ast.unparse(node) if isinstance(node, ast.expr) else "lookup"
                return unknown((f"{RAISES}{type(error).__name__} in {text}",), arch=arch)
            return Val(value, arch=arch, test=base.test, fact=base.fact)
        return unknown(base.deps or (node,), arch=arch)

    def _Slice(self, node: ast.Slice, scope: Scope) -> Val:
        parts = [
            self.eval(p, scope) if p is not None else Val(None)
            for p in (node.lower, node.upper, node.step)
        ]
        if all(concrete(p) for p in parts):
            return Val(slice(*(p.value for p in parts)), fact=True)
        return unknown((node,))

    def _sequence(self, node: ast.Tuple | ast.List | ast.Set, scope: Scope) -> Val:
        vals = [self.eval(e, scope) for e in node.elts]
        arch = any(v.arch for v in vals)
        if all(concrete(v) for v in vals) and not any(
            isinstance(e, ast.Starred) for e in node.elts
        ):
            items = [v.value for v in vals]
            value: object = tuple(items) if isinstance(node, ast.Tuple) else items
            if isinstance(node, ast.Set):
                try:
                    value = set(items)
                except TypeError:
                    return unknown((node,), arch=arch)
            return Val(value, arch=arch, fact=all(v.fact for v in vals))
        # A composite only partly known (a cache key holding the capability)
        # is not itself an architecture value.
        return unknown((node,))

    _Tuple = _sequence
    _List = _sequence
    _Set = _sequence

    def _Dict(self, node: ast.Dict, scope: Scope) -> Val:
        keys = [self.eval(k, scope) if k is not None else unknown((node,)) for k in node.keys]
        values = [self.eval(v, scope) for v in node.values]
        parts = keys + values
        if all(concrete(p) for p in parts):
            try:
                table = {k.value: v.value for k, v in zip(keys, values, strict=True)}
            except TypeError:  # an unhashable key
                return unknown((node,))
            return Val(table, arch=any(p.arch for p in parts), fact=all(p.fact for p in parts))
        return unknown((node,))

    def _NamedExpr(self, node: ast.NamedExpr, scope: Scope) -> Val:
        return self.eval(node.value, scope)

    def _Starred(self, node: ast.Starred, scope: Scope) -> Val:
        return self.eval(node.value, scope)

    def _other(self, node: ast.AST, scope: Scope) -> Val:
        """Anything else (comprehensions, lambdas, dicts, f-strings) is unknown.

        The site finder still looks inside it (comprehension conditions)."""
        return unknown((node,))
