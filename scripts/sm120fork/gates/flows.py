"""Values that reach a module from other modules: arguments and inherited attributes.

Two shapes the per-module evaluation cannot see on its own:

* a function called from another module with the architecture,
  `architecture_for_capability(major)` in lora/dense/runner.py, whose parameter
  then decides `if major >= 10:` in lora/utils.py;
* an attribute a class reads but another class assigns: a mixin's
  `self.device_sm_major`, set by the backend class that inherits it (in another
  module, or the same one), or a subclass reading what its base class set.

After pass two each module reports the calls it makes into other modules with
an architecture-derived argument (`outgoing_calls`) and its classes
(`class_facts`); pass three collects every call of those functions in the tree
(`gather_calls`: a parameter is derived from the architecture only if every
call found says so, as within one module); pass four analyses again the
modules these facts reach, where `external_arguments` and `inherited_attr`
answer for the evaluator. One hop: a value that needs two such hops is not
followed.
"""

from __future__ import annotations

import ast
import bisect
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

from sm120fork.gates.scopes import Binding, ModuleScopes, Scope
from sm120fork.gates.values import (
    CallArgs,
    ClassFacts,
    ClassRef,
    Dep,
    DepText,
    Export,
    LocalFn,
    Val,
    concrete,
    unknown,
)

if TYPE_CHECKING:
    from sm120fork.gates.context import Context
    from sm120fork.gates.evaluate import Evaluator
    from sm120fork.gates.hot import Hotness
    from sm120fork.gates.names import Names

# How far below a call's first line its arguments may be looked for.
_CALL_LINES = 40
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


def _arguments(call: ast.Call) -> Iterable[tuple[str, ast.expr | None]]:
    for i, arg in enumerate(call.args):
        if isinstance(arg, ast.Starred):
            yield "*", None
            return
        yield str(i), arg
    for keyword in call.keywords:
        yield (keyword.arg, keyword.value) if keyword.arg else ("**", None)


def _record(evaluators: list[Evaluator], call: ast.Call, scope: Scope, text: DepText) -> CallArgs:
    return tuple(
        (slot, tuple(text.portable(ev.eval(a, scope)) for ev in evaluators) if a else ())
        for slot, a in _arguments(call)
    )


def _named_calls(
    scopes: ModuleScopes,
    names: Iterable[str],
    lines_of: Callable[[str], set[int]],
    near: Callable[[int], bool] = lambda line: True,
) -> Iterable[tuple[ast.Call, Scope]]:
    """The calls starting on a line that names one of `names` (and is `near`)."""
    seen: set[int] = set()
    lines = set().union(*(lines_of(n) for n in names))
    for line in sorted(line for line in lines if near(line)):
        for call, scope in scopes.calls_on_line(line):
            if id(call) not in seen:
                seen.add(id(call))
                yield call, scope


def outgoing_calls(
    scopes: ModuleScopes,
    evaluators: list[Evaluator],
    reference: int,
    hotness: Hotness,
    modules: frozenset[str],
) -> dict[tuple[str, str], list[CallArgs]]:
    """This module's calls of other modules' names that pass an architecture-derived
    argument (`f(major)`, `mod.f(x, use_pdl=pdl)`), with what they pass."""
    names = {
        b.name
        for b in scopes.imports()
        if b.target.partition(":")[0] in modules or b.target in modules
    }
    hot, text = hotness.lines, DepText()
    ordered = sorted(hot)

    def near(line: int) -> bool:  # a hot line in the next few: where an argument may be
        i = bisect.bisect_left(ordered, line)
        return i < len(ordered) and ordered[i] <= line + _CALL_LINES

    found: dict[tuple[str, str], list[CallArgs]] = {}
    for call, scope in _named_calls(scopes, names, hotness.finder.of, near):
        args = [a for _, a in _arguments(call) if a is not None]
        if not any(_spans_hot(a, hot) for a in args):
            continue
        target = resolve(scopes, call.func, scope, modules)
        if target is not None and any(evaluators[reference].eval(a, scope).arch for a in args):
            found.setdefault(target, []).append(_record(evaluators, call, scope, text))
    return found


def _spans_hot(node: ast.AST, hot: frozenset[int]) -> bool:
    start = getattr(node, "lineno", 0)
    end = getattr(node, "end_lineno", start) or start
    return any(line in hot for line in range(start, end + 1))


def gather_calls(
    scopes: ModuleScopes,
    evaluators: list[Evaluator],
    lines_of: Callable[[str], set[int]],
    targets: frozenset[tuple[str, str]],
    modules: frozenset[str],
) -> dict[tuple[str, str], list[CallArgs]]:
    """What every call of `targets` in this module passes, per architecture."""
    text = DepText()
    found: dict[tuple[str, str], list[CallArgs]] = {}
    for call, scope in _named_calls(scopes, {name for _, name in targets}, lines_of):
        target = resolve(scopes, call.func, scope, modules)
        if target is not None and target in targets:
            found.setdefault(target, []).append(_record(evaluators, call, scope, text))
    return found


def class_facts(
    scopes: ModuleScopes,
    evaluators: list[Evaluator],
    reference: int,
    is_hot: Iterable[int],
    modules: frozenset[str],
) -> dict[ClassRef, ClassFacts]:
    """The module's top-level classes that other modules may inherit from or into."""
    hot = frozenset(is_hot)
    text = DepText()
    facts = {}
    for qualname, cls in scopes.classes().items():
        if "." in qualname:
            continue  # nested: no other module names it as a base
        bases = local_bases(scopes, cls, modules)
        sets = _assigned(cls)
        attrs = {}
        for attr in sets:
            bindings = _own(cls, attr)
            if not any(getattr(b.node, "lineno", 0) in hot for b in bindings):
                continue
            name = ast.Name(attr)
            if evaluators[reference].from_bindings(bindings, name, every=True).arch:
                values = (ev.from_bindings(bindings, name, every=True) for ev in evaluators)
                attrs[attr] = Export(tuple(text.portable(v) for v in values))
        if bases or attrs:
            facts[(scopes.module, qualname)] = ClassFacts(bases, sets, attrs)
    return facts


def _own(cls: Scope, attr: str) -> list[Binding]:
    """A class's bindings of `self.attr`, best first (as ModuleScopes.self_attr)."""
    return (cls.attrs.get(attr, []) + cls.names.get(attr, []))[::-1]


def _assigned(cls: Scope) -> frozenset[str]:
    names = {n for n, bs in cls.names.items() if any(b.kind in ("value", "opaque") for b in bs)}
    return frozenset(cls.attrs) | names


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


def _providers(ev: Names, owner: Scope, attr: str) -> list[Source]:
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
        bindings = _own(cls, attr)
        return bindings, bool(bindings), local_bases(scopes, cls, context.modules)
    facts = context.classes.get(ref)
    if facts is None:
        return None, False, ()
    return facts.attrs.get(attr), attr in facts.sets, facts.bases


def inherited_attr(ev: Names, owner: Scope, attr: str, node: ast.AST) -> Val | None:
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


def external_arguments(ev: Names, binding: Binding) -> list[Val] | None:
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


def flow_seeds(
    scopes: ModuleScopes, context: Context
) -> tuple[frozenset[str], frozenset[tuple[str, str]]]:
    """Names that can carry the architecture into this module from others, and
    the (function, parameter) pairs that other modules' calls pass it to."""
    names = set(context.attr_seeds(scopes.module))
    for cls in scopes.classes().values():  # what bases of other modules assign
        pending = list(local_bases(scopes, cls, context.modules))
        seen: set[ClassRef] = set()
        while pending:
            ref = pending.pop()
            facts = context.classes.get(ref)
            if ref not in seen and facts is not None:
                seen.add(ref)
                names.update(facts.attrs)
                pending.extend(facts.bases)
    params = set()
    for name in context.call_targets(scopes.module):
        fn = _function(scopes, name)
        if fn is None:
            continue
        args = fn.args
        for arg in [*args.posonlyargs, *args.args, *args.kwonlyargs]:
            if arg.arg not in ("self", "cls"):
                names.add(arg.arg)
                params.add((fn.name, arg.arg))
    return frozenset(names), frozenset(params)


def _function(scopes: ModuleScopes, name: str) -> ast.FunctionDef | None:
    bindings = scopes.root.names.get(name, [])
    node = bindings[-1].node if bindings and bindings[-1].kind == "def" else None
    if isinstance(node, ast.ClassDef):
        cls = scopes.classes().get(name)
        init = cls.names.get("__init__", []) if cls is not None else []
        node = init[-1].node if init and init[-1].kind == "def" else None
    return node if isinstance(node, ast.FunctionDef) else None
