"""Evaluate an expression of one module on one architecture, three-valued.

`Evaluator(scopes, arch, context).eval(node, scope)` computes what the
expression would be on `arch`: the helpers, capability and sm queries and
platform facts have their values (see `semantics`), names are resolved
through their bindings (module flags, aliases, `major, minor = ...`,
`self.x = ...`, imported flags of other modules), zero-argument functions of
the module are run path by path (`functions.Summaries`), and everything else
is unknown: `is_sm100_supported() and foo` is False on sm90 and depends on
`foo` on sm100.

Every operand is evaluated even where Python would short-circuit, so that
`arch` (derived from the architecture) does not depend on the architecture.
Results are memoised per syntax node: a node lives in exactly one scope.
Names and attributes live in `names`, operators in `operators`; calls here.
"""

from __future__ import annotations

import ast
from collections.abc import Callable

from sm120fork.gates import semantics
from sm120fork.gates.evaluator.context import Context
from sm120fork.gates.evaluator.functions import Summaries
from sm120fork.gates.evaluator.names import Names
from sm120fork.gates.evaluator.operators import Operators
from sm120fork.gates.hot import Hotness
from sm120fork.gates.model import Arch
from sm120fork.gates.scopes import ModuleScopes, Scope
from sm120fork.gates.values import (
    PLATFORM,
    BoundMethod,
    BuiltinFn,
    ExternalFn,
    HelperFn,
    LocalFn,
    ProbeFn,
    SourceFn,
    Val,
    concrete,
    unknown,
)

__all__ = ["Evaluator"]

# Builtins computed on known values (int(major), max(sm, 90), ...); see names.BUILTINS.
_BUILTINS: dict[str, Callable[..., object]] = {
    "int": int,
    "str": str,
    "float": float,
    "tuple": tuple,
    "bool": bool,
    "min": min,
    "max": max,
    "abs": abs,
    "len": len,
}


class Evaluator(Names, Operators):
    """Evaluates expressions of one module on one architecture (dispatch on node type)."""

    def __init__(
        self, scopes: ModuleScopes, arch: Arch, context: Context, hotness: Hotness | None = None
    ) -> None:
        self.hotness = hotness
        self.scopes = scopes
        self.arch = arch
        self.context = context
        self.index = context.arch_index.get(arch.name, 0)
        self.memo: dict[int, Val] = {}
        self.active: set[int] = set()
        self.unknown_helpers: set[str] = set()
        self.summaries = Summaries(self)

    def eval(self, node: ast.AST, scope: Scope) -> Val:
        key = id(node)
        cached = self.memo.get(key)
        if cached is not None:
            return cached
        if key in self.active:  # a binding that refers to itself
            return unknown((node,))
        self.active.add(key)
        try:
            method = getattr(self, "_" + type(node).__name__, None)
            val = method(node, scope) if method is not None else self._other(node, scope)
        finally:
            self.active.discard(key)
        self.memo[key] = val
        return val

    def dispose(self) -> None:
        """Drop the memo and break the evaluator <-> summaries cycle."""
        self.memo.clear()
        self.summaries.memo.clear()
        del self.summaries

    def _Call(self, node: ast.Call, scope: Scope) -> Val:
        func = self.eval(node.func, scope)
        args = [self.eval(a, scope) for a in node.args]
        kwargs = [self.eval(k.value, scope) for k in node.keywords]
        arch = func.arch or any(a.arch for a in args) or any(k.arch for k in kwargs)
        target = func.value if func.known else None
        if isinstance(target, HelperFn):
            test = semantics.helper_test(target.name, method=target.method)
            if test is None:
                self.unknown_helpers.add(target.name)
                return unknown((node,), arch=True, test=True)
            answer = test(self.arch)
            if answer is None:  # depends on more than the architecture here
                return unknown((node,), arch=True, test=True)
            return Val(answer, arch=True, test=True, fact=True)
        if isinstance(target, ProbeFn):
            return Val(target.value, fact=True)
        if isinstance(target, SourceFn):
            return self._source(target.kind, args, node, arch)
        if isinstance(target, LocalFn | ExternalFn):
            if node.args or node.keywords:
                return unknown((node,))
            if isinstance(target, ExternalFn):
                return target.results[self.index]
            return self.summaries.call(target, node)
        if isinstance(target, BoundMethod) and not args:
            obj = target.obj
            if target.name == "to_int" and isinstance(obj, semantics.Capability):
                return Val(obj.to_int(), arch=arch, fact=True)
            if target.name == "as_version_str" and isinstance(obj, semantics.Capability):
                return Val(obj.as_version_str(), arch=arch, fact=True)
        if (
            len(node.args) == 1
            and isinstance(node.args[0], ast.Starred)
            and concrete(args[0])
            and isinstance(args[0].value, semantics.Capability)
        ):  # DeviceCapability(*torch.cuda.get_device_capability())
            return Val(args[0].value, arch=True, fact=True)
        if (
            isinstance(target, BuiltinFn)
            and args
            and not node.keywords
            and all(concrete(a) for a in args)
        ):
            try:
                result = _BUILTINS[target.name](*(a.value for a in args))
            except Exception:
                return unknown((node,), arch=arch)
            return Val(result, arch=arch, fact=all(a.fact for a in args))
        # An opaque call: what it does with an architecture argument is its own
        # business (its gates are found where it is defined).
        return unknown((node,), arch=func.arch)

    def _source(self, kind: str, args: list[Val], node: ast.AST, arch: bool) -> Val:
        if kind == "capability":
            return Val(semantics.Capability(self.arch.major, self.arch.minor), arch=True, fact=True)
        if kind == "sm":
            return Val(self.arch.sm, arch=True, fact=True)
        if kind == "platform":
            return Val(PLATFORM, arch=arch)
        if args and concrete(args[0]):
            answer = semantics.has_capability(self.arch, args[0].value)
            if answer is not None:
                return Val(answer, arch=True, test=True, fact=True)
        return unknown((node,), arch=True, test=True)
