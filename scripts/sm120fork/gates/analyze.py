"""One module: parse it, find and evaluate its gates, list what it exports."""

from __future__ import annotations

import ast
from dataclasses import dataclass, field

from sm120fork.gates import semantics
from sm120fork.gates.binder import build_scopes
from sm120fork.gates.evaluator import Context, Evaluator, zero_argument
from sm120fork.gates.flows import class_facts, flow_seeds, gather_calls, outgoing_calls
from sm120fork.gates.hot import Hotness, hot_lines
from sm120fork.gates.model import ARCHS, Gate, ScanProblem
from sm120fork.gates.scopes import ModuleScopes
from sm120fork.gates.sites import SiteFinder
from sm120fork.gates.values import (
    CallArgs,
    ClassFacts,
    ClassRef,
    DepText,
    Export,
    ExternalFn,
    LocalFn,
    Val,
    concrete,
)

REFERENCE = next(i for i, a in enumerate(ARCHS) if a.name == "sm120")
ARCH_INDEX = {arch.name: i for i, arch in enumerate(ARCHS)}


@dataclass
class ParsedModule:
    relpath: str
    text: str
    scopes: ModuleScopes
    _hotness: dict[tuple[frozenset[str], frozenset[tuple[str, str]]], Hotness] = field(
        default_factory=dict
    )

    def hotness(self, seeds: set[str], params: frozenset[tuple[str, str]] = frozenset()) -> Hotness:
        """The hot lines for these imported seeds (the same in both passes, mostly)."""
        key = (frozenset(seeds), params)
        found = self._hotness.get(key)
        if found is None:
            found = self._hotness[key] = hot_lines(self.text, self.scopes, key[0], params)
        return found


@dataclass(frozen=True)
class ModuleResult:
    relpath: str
    module: str
    gates: tuple[Gate, ...]
    exports: dict[str, Export]
    unknown_helpers: frozenset[str]
    imports: frozenset[tuple[str, str]]  # (module, name) imported; name "" for a module
    # other modules' functions it passes the architecture to, and its classes (flows.py)
    calls_out: dict[tuple[str, str], list[CallArgs]] = field(default_factory=dict)
    classes: dict[ClassRef, ClassFacts] = field(default_factory=dict)


def parse_module(relpath: str, data: bytes) -> ParsedModule | ScanProblem:
    try:
        tree = ast.parse(data, filename=relpath)
    except (SyntaxError, ValueError, RecursionError, MemoryError) as error:
        return ScanProblem(relpath, f"cannot parse: {type(error).__name__}: {error}")
    text = data.decode("utf-8", errors="replace")
    return ParsedModule(relpath, text, build_scopes(tree, relpath, walrus=":=" in text))


def analyse_module(
    parsed: ParsedModule, context: Context, *, outgoing: bool = True
) -> ModuleResult:
    """The module's gates and exports, and (`outgoing`) what flows from it to
    other modules; `parsed` can be analysed again later."""
    context.arch_index = ARCH_INDEX
    scopes = parsed.scopes
    imports = frozenset(_import_pairs(scopes))
    seeds = _imported_seeds(scopes, context)
    names, params = flow_seeds(scopes, context)
    hotness = parsed.hotness(seeds | names, params)
    evaluators = [Evaluator(scopes, arch, context, hotness) for arch in ARCHS]
    text = DepText()
    gates = tuple(_gates(parsed, evaluators, hotness.lines, text))
    exports = _exports(parsed, evaluators, hotness.names, text)
    calls_out: dict[tuple[str, str], list[CallArgs]] = {}
    classes: dict[ClassRef, ClassFacts] = {}
    if outgoing and context.modules:  # a tree: what other modules may take from this one
        calls_out = outgoing_calls(scopes, evaluators, REFERENCE, hotness, context.modules)
        classes = class_facts(scopes, evaluators, REFERENCE, hotness.lines, context.modules)
    unknown_helpers: set[str] = set()
    for ev in evaluators:
        unknown_helpers |= ev.unknown_helpers
        ev.dispose()
    return ModuleResult(
        parsed.relpath,
        scopes.module,
        gates,
        exports,
        frozenset(unknown_helpers),
        imports,
        calls_out,
        classes,
    )


def module_calls(
    parsed: ParsedModule, context: Context, targets: frozenset[tuple[str, str]]
) -> dict[tuple[str, str], list[CallArgs]]:
    """What this module's calls of `targets` (other modules' names) pass them."""
    context.arch_index = ARCH_INDEX
    hotness = parsed.hotness(_imported_seeds(parsed.scopes, context))
    evaluators = [Evaluator(parsed.scopes, arch, context, hotness) for arch in ARCHS]
    try:
        return gather_calls(parsed.scopes, evaluators, hotness.finder.of, targets, context.modules)
    finally:
        for ev in evaluators:
            ev.dispose()


def module_exports(parsed: ParsedModule, context: Context) -> dict[str, Export]:
    """Only what the module exports (pass one: before other modules' exports are known)."""
    context.arch_index = ARCH_INDEX
    hotness = parsed.hotness(_imported_seeds(parsed.scopes, context))
    evaluators = [Evaluator(parsed.scopes, arch, context, hotness) for arch in ARCHS]
    try:
        return _exports(parsed, evaluators, hotness.names, DepText())
    finally:
        for ev in evaluators:
            ev.dispose()


def _import_pairs(scopes: ModuleScopes) -> set[tuple[str, str]]:
    """(module, name) for `from module import name`; (module, "") for `import module`."""
    pairs = set()
    for binding in scopes.imports():
        module, _, name = binding.target.partition(":")
        pairs.add((module, name))
    return pairs


def _imported_seeds(scopes: ModuleScopes, context: Context) -> set[str]:
    """Local names through which this module can reach another module's exports."""
    if not context.exports:
        return set()
    seeds = set()
    for binding in scopes.imports():
        module, _, name = binding.target.partition(":")
        full = f"{module}.{name}" if name else module
        if (name and context.resolve(module, name) is not None) or context.exports_under(full):
            seeds.add(binding.name)
    return seeds


def _gates(
    parsed: ParsedModule, evaluators: list[Evaluator], hot: frozenset[int], text: DepText
) -> list[Gate]:
    sites = SiteFinder(parsed.scopes, evaluators[REFERENCE], hot).run()
    gates = []
    for site in sites:
        condition = ast.unparse(site.node)
        archs = {
            arch.name: text.render(ev.eval(site.node, site.scope), condition)
            for arch, ev in zip(ARCHS, evaluators, strict=True)
        }
        gates.append(
            Gate(
                file=parsed.relpath,
                line=site.node.lineno,
                function=site.scope.qualname,
                kind=site.kind,
                condition=condition,
                archs=archs,
                within=site.within,
                guarded=site.guarded,
            )
        )
    return gates


def _exports(
    parsed: ParsedModule, evaluators: list[Evaluator], names: frozenset[str], text: DepText
) -> dict[str, Export]:
    """Module-level names whose value derives from the architecture."""
    reference = evaluators[REFERENCE]
    exports: dict[str, Export] = {}
    for name, bindings in parsed.scopes.root.names.items():
        if name not in names or semantics.named(name):
            continue
        candidates = bindings[::-1]
        val = reference.from_bindings(candidates, ast.Name(name))
        if isinstance(val.value, LocalFn):
            fn = val.value
            if not zero_argument(fn):
                continue
            call = ast.Call(func=ast.Name(name), args=[], keywords=[])
            results = [ev.summaries.call(fn, call) for ev in evaluators]
            if results[REFERENCE].arch:
                portable = ExternalFn(tuple(text.portable(r) for r in results))
                exports[name] = Export(tuple(Val(portable) for _ in ARCHS))
            continue
        if val.arch:
            values = [ev.from_bindings(candidates, ast.Name(name)) for ev in evaluators]
            exports[name] = Export(tuple(text.portable(v) for v in values))
    return exports


def importable(name: str, export: Export) -> bool:
    """Worth looking for in files without gate tokens: a flag or an arch value.

    Generic names (`main`, `enabled`, `_`) would make every file a candidate.
    """
    core = name.strip("_")
    if len(name) < 6 or ("_" not in core and core.islower()):
        return False
    val = export.values[REFERENCE]
    if isinstance(val.value, ExternalFn):  # a function some architecture answers yes/no
        return any(concrete(r) and isinstance(r.value, bool) for r in val.value.results)
    return val.test or (isinstance(val.value, int | tuple) and not isinstance(val.value, bool))
