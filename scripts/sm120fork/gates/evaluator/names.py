"""Evaluating names and attributes: what a name means where it is used.

Bindings (assignments, tuple unpacking, `self.x = ...`, imports, parameters),
the helpers and probes known by name, the platform object's facts, and other
modules' exports.
"""

from __future__ import annotations

import ast

from sm120fork.gates import semantics
from sm120fork.gates.evaluator.base import EvaluatorBase
from sm120fork.gates.evaluator.context import merge
from sm120fork.gates.evaluator.external import agree, external_arguments, inherited_attr
from sm120fork.gates.scopes import Binding, Scope, argument_for
from sm120fork.gates.values import (
    BoundMethod,
    BuiltinFn,
    HelperFn,
    LocalFn,
    ModuleRef,
    PlatformObj,
    ProbeFn,
    SourceFn,
    Symbol,
    Val,
    concrete,
    unknown,
)

BUILTINS = frozenset(("int", "str", "float", "tuple", "bool", "min", "max", "abs", "len"))


class Names(EvaluatorBase):
    def _Name(self, node: ast.Name, scope: Scope) -> Val:
        name = node.id
        bindings = self.scopes.lookup(name, scope, (node.lineno, node.col_offset))
        special = self._special_name(name, bindings)
        if special is not None:
            return special
        if not bindings:
            return Val(BuiltinFn(name)) if name in BUILTINS else unknown((node,))
        return self.from_bindings(bindings, node)

    def _special_name(self, name: str, bindings: list[Binding]) -> Val | None:
        """Helpers, probes and sources called by their own name."""
        if bindings:
            first = bindings[0]
            own = first.kind in ("import", "def") or (
                first.kind == "value" and first.scope is not None and first.scope.kind == "module"
            )
            if not own:
                return None
        return self.named_symbol(name, method=False)

    def named_symbol(self, name: str, *, method: bool) -> Val | None:
        if semantics.is_helper_name(name):
            return Val(HelperFn(name, method))
        if name in semantics.PLATFORM_PROBES:
            return Val(ProbeFn(semantics.PLATFORM_PROBES[name]))
        if name in semantics.CAPABILITY_FUNCS:
            return Val(SourceFn("capability"))
        if name in semantics.SM_FUNCS:
            return Val(SourceFn("sm"))
        if name in semantics.HAS_CAPABILITY_FUNCS:
            return Val(SourceFn("has_capability"))
        if name in semantics.PLATFORM_GETTERS:
            return Val(SourceFn("platform"))
        return None

    def from_bindings(self, bindings: list[Binding], node: ast.AST, *, every: bool = False) -> Val:
        """The value of the best candidate binding: the first architecture-derived one.

        `every`: attributes of `self`, written from many methods, count as
        derived from the architecture only if every write is.
        """
        vals = [self.binding_value(b) for b in bindings]
        if every:
            if all(v.arch for v in vals):
                return vals[0]
        else:
            for val in vals:
                if val.arch:
                    return val
        first = vals[0]
        if first.known and (first.fact or isinstance(first.value, Symbol)):
            return first
        return unknown((node,))

    def binding_value(self, binding: Binding) -> Val:
        kind = binding.kind
        if kind == "value" and binding.node is not None and binding.scope is not None:
            val = self.eval(binding.node, binding.scope)
            for i in binding.index:
                val = self._item(val, Val(i, fact=True), binding.node)
            if val.known and not val.fact and self._constant(binding):
                val = Val(val.value, val.deps, val.arch, val.test, fact=True)
            return val
        if kind == "module":
            return Val(ModuleRef(binding.target))
        if kind == "import":
            module, _, name = binding.target.partition(":")
            return self.imported(module, name, binding)
        if kind == "param":
            return self.param_value(binding)
        if kind == "def" and isinstance(binding.node, ast.FunctionDef | ast.AsyncFunctionDef):
            assert binding.scope is not None
            return Val(LocalFn(binding.node, binding.scope, bound=False))
        return unknown((binding.name,))

    def _constant(self, binding: Binding) -> bool:
        """A module-level name bound once, to a literal (`SUPPORTED = {(9, 0), (10, 0)}`)."""
        if binding.scope is not self.scopes.root or binding.index:
            return False
        if len(self.scopes.root.names.get(binding.name, ())) != 1:
            return False
        if binding.name in self.scopes.rebound:
            return False
        try:
            ast.literal_eval(binding.node)  # type: ignore[arg-type]
        except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
            return False
        return True

    def param_value(self, binding: Binding) -> Val:
        """A parameter is derived from the architecture when every call in the
        module passes such a value (`self._set_default_nsa_backends(..., major)`)."""
        fn = binding.node
        if not isinstance(fn, ast.FunctionDef | ast.AsyncFunctionDef) or binding.scope is None:
            return unknown((binding.name,))
        hotness = self.hotness
        external = external_arguments(self, binding)  # calls from other modules
        if (
            hotness is not None
            and (fn.name, binding.name) not in hotness.params
            and external is None
        ):
            return unknown((binding.name,))  # no call passes it anything architectural
        key = id(binding)
        cached = self.memo.get(key)
        if cached is not None:
            return cached
        if key in self.active:
            return unknown((binding.name,))
        self.active.add(key)
        try:
            lines = hotness.finder.of(fn.name) if hotness is not None else None
            vals = [
                self._argument(fn, binding, call, scope)
                for call, scope in self.scopes.calls_to(fn.name, lines)
            ] + (external or [])
        finally:
            self.active.discard(key)
        result = self.memo[key] = agree(vals, binding.name)
        return result

    def _argument(
        self,
        fn: ast.FunctionDef | ast.AsyncFunctionDef,
        binding: Binding,
        call: ast.Call,
        scope: Scope,
    ) -> Val:
        """What `call` passes for the parameter `binding` of `fn`."""
        argument = argument_for(fn, binding, call)
        return self.eval(argument, scope) if argument is not None else unknown((call,))

    def imported(self, module: str, name: str, binding: Binding) -> Val:
        special = self.named_symbol(name, method=False)
        if special is not None:
            return special
        probe = semantics.PLATFORM_PROBES.get(name.lstrip("_"))
        if probe is not None:  # `from ... import _is_cuda`: sglang's cached probes
            return Val(probe, fact=True)
        full = f"{module}.{name}" if module else name
        if full in self.context.modules:
            return Val(ModuleRef(full))
        export = self.export(module, name)
        if export is not None:
            return export
        return unknown((binding.name,))

    def export(self, module: str, name: str) -> Val | None:
        found = self.context.resolve(module, name)
        if found is None:
            return None
        return found.values[self.index]

    # -- attributes and calls -------------------------------------------------

    def _Attribute(self, node: ast.Attribute, scope: Scope) -> Val:
        attr = node.attr
        base_node = node.value
        if (
            isinstance(base_node, ast.Name)
            and scope.self_name is not None
            and base_node.id == scope.self_name
        ):
            bindings = self.scopes.self_attr(scope, attr)
            if bindings:
                val = self.from_bindings(bindings, node, every=True)
                if isinstance(val.value, LocalFn):
                    fn = val.value
                    return Val(LocalFn(fn.node, fn.scope, bound=True))
                return val
            symbol = self.named_symbol(attr, method=True)
            if symbol is None and scope.owner is not None:  # a base or a subclass assigns it
                symbol = inherited_attr(self, scope.owner, attr, node)
            return symbol or unknown((node,))
        base = self.eval(base_node, scope)
        value = base.value if base.known else None
        if isinstance(value, PlatformObj):
            return self._platform_fact(attr, node)
        if isinstance(value, ModuleRef):
            return self._module_attr(value.name, attr, node)
        if isinstance(value, semantics.Capability) or (
            concrete(base) and hasattr(value, "major") and attr in ("major", "minor")
        ):
            if attr in ("to_int", "as_version_str"):
                return Val(BoundMethod(value, attr), arch=base.arch, fact=True)
            if attr in ("major", "minor"):
                return Val(getattr(value, attr), arch=base.arch, fact=True)
        symbol = self.named_symbol(attr, method=True)
        if symbol is not None and not isinstance(value, semantics.Capability):
            return merge(symbol, arch=base.arch)
        return unknown((node,), arch=base.arch)

    def _platform_fact(self, attr: str, node: ast.AST) -> Val:
        helper = semantics.PLATFORM_FACTS.get(attr)
        if helper is not None:
            answer = semantics.HELPERS[helper](self.arch)
            if answer is None:
                return unknown((node,), arch=True, test=True)
            return Val(answer, arch=True, test=True, fact=True)
        kind = semantics.PLATFORM_VALUES.get(attr)
        if kind == "sm":
            return Val(self.arch.sm, arch=True, fact=True)
        if kind == "capability":
            return Val(semantics.Capability(self.arch.major, self.arch.minor), arch=True, fact=True)
        if attr in semantics.PLATFORM_PROBES:
            return Val(semantics.PLATFORM_PROBES[attr], fact=True)
        return unknown((node,))

    def _module_attr(self, module: str, attr: str, node: ast.AST) -> Val:
        if module == "torch.version" and attr == "hip":
            return Val(None, fact=True)
        if module == "torch.cuda" and attr == "is_available":
            return Val(ProbeFn(True))
        symbol = self.named_symbol(attr, method=False)
        if symbol is not None:
            return symbol
        export = self.export(module, attr)
        if export is not None:
            return export
        full = f"{module}.{attr}"
        if full in self.context.modules or "." not in module or module.startswith("torch"):
            return Val(ModuleRef(full))
        return unknown((node,))
