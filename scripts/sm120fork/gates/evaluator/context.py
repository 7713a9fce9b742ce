"""What an evaluator works with: the tree's exports.

`Context` is what a module knows of the rest of the tree: other modules'
architecture-derived names and, once every module has been analysed, what
flows in from them (`gates.flows`: the calls other modules make to this
module's functions, and the classes related to its classes).
"""

from __future__ import annotations

import ast
from dataclasses import dataclass, field

from sm120fork.gates.values import CallArgs, ClassFacts, ClassRef, Dep, Export, ExportTable, Val


@dataclass
class Context:
    """What the module knows of the rest of the tree."""

    exports: ExportTable = field(default_factory=dict)
    modules: frozenset[str] = frozenset()  # every module of the tree
    by_name: dict[str, list[str]] = field(default_factory=dict)  # export name -> modules
    arch_index: dict[str, int] = field(default_factory=dict)
    # (module, function or class) -> what every call from another module passes it
    calls: dict[tuple[str, str], list[CallArgs]] = field(default_factory=dict)
    classes: dict[ClassRef, ClassFacts] = field(default_factory=dict)
    _under: frozenset[str] | None = None
    _subclasses: dict[ClassRef, list[ClassRef]] | None = None
    _attr_seeds: dict[str, frozenset[str]] | None = None
    _targets: dict[str, frozenset[str]] | None = None

    def exports_under(self, module: str) -> bool:
        """Does `module` or a module inside it export anything?"""
        if not self.exports:
            return False
        if self._under is None:
            under: set[str] = set()
            for owner, _ in self.exports:
                parts = owner.split(".")
                under.update(".".join(parts[:i]) for i in range(1, len(parts) + 1))
            self._under = frozenset(under)
        return module in self._under

    def resolve(self, module: str, name: str) -> Export | None:
        found = self.exports.get((module, name))
        if found is None:  # a package re-exporting a submodule's name
            owners = [m for m in self.by_name.get(name, ()) if m.startswith(module + ".")]
            if len(owners) == 1:
                found = self.exports.get((owners[0], name))
        return found

    def subclasses(self, ref: ClassRef) -> list[ClassRef]:
        """The classes of other modules that name `ref` as a base."""
        if self._subclasses is None:
            index: dict[ClassRef, list[ClassRef]] = {}
            for child, facts in self.classes.items():
                for base in facts.bases:
                    index.setdefault(base, []).append(child)
            self._subclasses = index
        return self._subclasses.get(ref, [])

    def call_targets(self, module: str) -> frozenset[str]:
        """Names of `module` (functions, classes) that other modules call."""
        if self._targets is None:
            targets: dict[str, set[str]] = {}
            for owner, name in self.calls:
                targets.setdefault(owner, set()).add(name)
            self._targets = {m: frozenset(names) for m, names in targets.items()}
        return self._targets.get(module, frozenset())

    def attr_seeds(self, module: str) -> frozenset[str]:
        """Architecture-derived attributes that classes of other modules, related
        by inheritance (either way) to a class of `module`, assign."""
        if self._attr_seeds is None:
            seeds: dict[str, set[str]] = {}
            for ref, facts in self.classes.items():
                if facts.attrs:
                    for module, _ in self._related(ref):
                        if module != ref[0]:  # within one module pass two saw it
                            seeds.setdefault(module, set()).update(facts.attrs)
            self._attr_seeds = {m: frozenset(names) for m, names in seeds.items()}
        return self._attr_seeds.get(module, frozenset())

    def providers(self) -> frozenset[str]:
        """Names of the classes that assign an architecture-derived attribute
        (a module naming one may inherit from it)."""
        return frozenset(ref[1] for ref, facts in self.classes.items() if facts.attrs)

    def _related(self, start: ClassRef) -> set[ClassRef]:
        """`start`, its bases and its subclasses, transitively."""
        found = {start}
        for step in (
            lambda r: self.classes[r].bases if r in self.classes else (),
            self.subclasses,
        ):
            pending = [start]
            while pending:
                for nxt in step(pending.pop()):
                    if nxt not in found:
                        found.add(nxt)
                        pending.append(nxt)
        return found


def depof(val: Val, node: ast.AST) -> frozenset[Dep]:
    return val.deps if val.deps else frozenset((node,))


def merge(val: Val, *, arch: bool, test: bool | None = None) -> Val:
    return Val(val.value, val.deps, val.arch or arch, val.test if test is None else test, val.fact)
