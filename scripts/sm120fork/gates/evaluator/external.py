"""What the evaluator reads from other modules: the arguments their calls pass
this module's functions (`external_arguments`) and the attributes related
classes assign (`inherited_attr`); `gates.flows` gathers both between passes.
"""

from __future__ import annotations

import ast

from sm120fork.gates.evaluator.base import EvaluatorBase
from sm120fork.gates.evaluator.context import Context
from sm120fork.gates.scopes import Binding, ModuleScopes, Scope
from sm120fork.gates.values import ClassRef, Dep, Export, LocalFn, Val, concrete, unknown

# One provider of an attribute: this module's bindings, another module's
# values, or None where another module assigns it something not architectural.
Source = list[Binding] | Export | None


def resolve(
    scopes: ModuleScopes, expr: ast.expr, scope: Scope, modules: frozenset[str]
) -> tuple[str, str] | None:
    """(module, name) of a top-level name `expr` refers to: another module's
    (`f`, `mod.f`, `pkg.mod.f` through imports) or a top-level class of this one."""
    parts: list[str] = []
    node = expr
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return None
    parts.reverse()
    bindings = scopes.lookup(node.id, scope, (expr.lineno, expr.col_offset))
    if not bindings:
        return None
    first = bindings[0]
    if first.kind == "def" and not parts:
        is_class = isinstance(first.node, ast.ClassDef)
        return (scopes.module, node.id) if is_class and first.scope is scopes.root else None
    if first.kind == "import":
        module, _, name = first.target.partition(":")
        path = f"{module}.{name}"
        if path not in modules:
            other = module in modules and module != scopes.module
            return (module, name) if other and not parts else None
    elif first.kind == "module":
        path = first.target
    else:
        return None
    if not parts:
        return None
    full = ".".join([path, *parts[:-1]])
    return (full, parts[-1]) if full in modules and full != scopes.module else None


def own(cls: Scope, attr: str) -> list[Binding]:
    """A class's bindings of `self.attr`, best first (as ModuleScopes.self_attr)."""
    return (cls.attrs.get(attr, []) + cls.names.get(attr, []))[::-1]


def local_bases(scopes: ModuleScopes, cls: Scope, modules: frozenset[str]) -> tuple[ClassRef, ...]:
    """The bases of a class of this module that are classes of the tree."""
    memo: dict[int, tuple[ClassRef, ...]] = scopes.memo.setdefault("bases", {})
    key = id(cls)
    if key not in memo:
        node = cls.node
        assert isinstance(node, ast.ClassDef) and cls.parent is not None
        found = (resolve(scopes, base, cls.parent, modules) for base in node.bases)
        memo[key] = tuple(ref for ref in found if ref is not None)
    return memo[key]


def _local_children(scopes: ModuleScopes, ref: ClassRef, modules: frozenset[str]) -> list[Scope]:
    return [
        cls
        for qualname, cls in scopes.classes().items()
        if "." not in qualname and ref in local_bases(scopes, cls, modules)
    ]


def _providers(ev: EvaluatorBase, owner: Scope, attr: str) -> list[Source]:
    """Who assigns `attr` for a class that reads it without assigning it: the
    nearest base class that does, else every subclass that does."""
    scopes, context, modules = ev.scopes, ev.context, ev.context.modules
    start: ClassRef = (scopes.module, owner.qualname)
    seen = {start}
    pending = list(local_bases(scopes, owner, modules))
    while pending:  # up: bases, nearest first
        ref = pending.pop(0)
        if ref in seen:
            continue
        seen.add(ref)
        source, found, bases = _class_source(scopes, context, ref, attr)
        if found:
            return [source]
        pending.extend(bases)
    sources: list[Source] = []
    pending = [start]
    while pending:  # down: every subclass, transitively
        ref = pending.pop()
        children: list[ClassRef] = list(context.subclasses(ref))
        if ref[0] == scopes.module:
            children += [(scopes.module, c.qualname) for c in _local_children(scopes, ref, modules)]
        for child in children:
            if child in seen:
                continue
            seen.add(child)
            source, found, _ = _class_source(scopes, context, child, attr)
            if found:
                sources.append(source)
            else:
                pending.append(child)
    return sources


def _class_source(
    scopes: ModuleScopes, context: Context, ref: ClassRef, attr: str
) -> tuple[Source, bool, tuple[ClassRef, ...]]:
    """(what class `ref` assigns to attr, whether it does, its bases)."""
    if ref[0] == scopes.module:
        cls = scopes.classes().get(ref[1])
        if cls is None:
            return None, False, ()
        bindings = own(cls, attr)
        return bindings, bool(bindings), local_bases(scopes, cls, context.modules)
    facts = context.classes.get(ref)
    if facts is None:
        return None, False, ()
    return facts.attrs.get(attr), attr in facts.sets, facts.bases


def inherited_attr(ev: EvaluatorBase, owner: Scope, attr: str, node: ast.AST) -> Val | None:
    """`self.attr` read in a class that does not assign it (None: nobody known does)."""
    sources = _providers(ev, owner, attr)
    if not sources:
        return None
    vals = []
    for source in sources:
        if source is None:
            return None  # assigned something not architectural somewhere
        if isinstance(source, Export):
            vals.append(source.values[ev.index])
            continue
        val = ev.from_bindings(source, node, every=True)
        if isinstance(val.value, LocalFn) and len(sources) == 1:
            return Val(LocalFn(val.value.node, val.value.scope, bound=True))
        vals.append(val)
    return vals[0] if len(vals) == 1 else agree(vals, attr)


def agree(vals: list[Val], name: str) -> Val:
    """One value from what every provider (every call, every subclass) supplies."""
    if not vals or not all(v.arch for v in vals):
        return unknown((name,))
    if all(concrete(v) for v in vals) and all(v.value == vals[0].value for v in vals):
        return vals[0]
    deps: set[Dep] = set()
    for val in vals:
        deps |= val.deps
    return unknown(deps or (name,), arch=True, test=all(v.test for v in vals))


def target_of(scopes: ModuleScopes, binding: Binding) -> tuple[tuple[str, str], int] | None:
    """The name other modules call to pass parameter `binding`, and how many
    leading parameters the call does not pass (`self` of `__init__`)."""
    fn, scope = binding.node, binding.scope
    if scope is None or scope.parent is None or not isinstance(fn, ast.FunctionDef):
        return None
    parent = scope.parent
    if parent is scopes.root:
        return (scopes.module, fn.name), 0
    if fn.name == "__init__" and parent.kind == "class" and parent.parent is scopes.root:
        return (scopes.module, parent.qualname), 1
    return None


def external_arguments(ev: EvaluatorBase, binding: Binding) -> list[Val] | None:
    """What the calls from other modules pass for parameter `binding` (None: no such call)."""
    found = target_of(ev.scopes, binding)
    if found is None:
        return None
    target, skipped = found
    records = ev.context.calls.get(target)
    if not records:
        return None
    fn = binding.node
    assert isinstance(fn, ast.FunctionDef)
    positional = len(fn.args.posonlyargs) + len(fn.args.args)
    position = binding.index[0]
    vals = []
    for record in records:
        passed = dict(record)
        values = passed.get(binding.name) if position >= len(fn.args.posonlyargs) else None
        if values is None and skipped <= position < positional:
            values = passed.get(str(position - skipped))
        vals.append(values[ev.index] if values else unknown((binding.name,)))
    return vals
