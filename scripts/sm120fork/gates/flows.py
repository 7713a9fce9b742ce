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
modules these facts reach, where `evaluator.external` answers for the
evaluator from them. One hop: a value that needs two such hops is not
followed.
"""

from __future__ import annotations

import ast
import bisect
from collections.abc import Callable, Iterable

from sm120fork.gates.evaluator import Context, Evaluator
from sm120fork.gates.evaluator.external import local_bases, own, resolve
from sm120fork.gates.hot import Hotness
from sm120fork.gates.scopes import ModuleScopes, Scope
from sm120fork.gates.values import (
    CallArgs,
    ClassFacts,
    ClassRef,
    DepText,
    Export,
)

# How far below a call's first line its arguments may be looked for.
_CALL_LINES = 40


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
            bindings = own(cls, attr)
            if not any(getattr(b.node, "lineno", 0) in hot for b in bindings):
                continue
            name = ast.Name(attr)
            if evaluators[reference].from_bindings(bindings, name, every=True).arch:
                values = (ev.from_bindings(bindings, name, every=True) for ev in evaluators)
                attrs[attr] = Export(tuple(text.portable(v) for v in values))
        if bases or attrs:
            facts[(scopes.module, qualname)] = ClassFacts(bases, sets, attrs)
    return facts


def _assigned(cls: Scope) -> frozenset[str]:
    names = {n for n, bs in cls.names.items() if any(b.kind in ("value", "opaque") for b in bs)}
    return frozenset(cls.attrs) | names


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
