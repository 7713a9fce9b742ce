"""What an evaluator works with: the tree's exports, and the evaluator's shape.

`Context` is what a module knows of the rest of the tree (other modules'
architecture-derived names). `EvaluatorBase` declares what the parts of the
evaluator (`names`, `operators`, `evaluate`) share.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from sm120fork.gates.model import Arch
from sm120fork.gates.scopes import ModuleScopes, Scope
from sm120fork.gates.values import Dep, Export, ExportTable, Val

if TYPE_CHECKING:
    from sm120fork.gates.functions import Summaries
    from sm120fork.gates.hot import Hotness


@dataclass
class Context:
    """What the module knows of the rest of the tree."""

    exports: ExportTable = field(default_factory=dict)
    modules: frozenset[str] = frozenset()  # every module of the tree
    by_name: dict[str, list[str]] = field(default_factory=dict)  # export name -> modules
    arch_index: dict[str, int] = field(default_factory=dict)
    _under: frozenset[str] | None = None

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


def depof(val: Val, node: ast.AST) -> frozenset[Dep]:
    return val.deps if val.deps else frozenset((node,))


def merge(val: Val, *, arch: bool, test: bool | None = None) -> Val:
    return Val(val.value, val.deps, val.arch or arch, val.test if test is None else test, val.fact)


class EvaluatorBase:
    """The state and the methods the evaluator's parts rely on each other for."""

    scopes: ModuleScopes
    arch: Arch
    context: Context
    index: int  # the architecture's position in ARCHS (for other modules' exports)
    memo: dict[int, Val]
    active: set[int]
    unknown_helpers: set[str]
    summaries: Summaries
    hotness: Hotness | None  # None: consider every parameter and call

    def eval(self, node: ast.AST, scope: Scope) -> Val:
        raise NotImplementedError

    def _item(self, base: Val, index: Val, node: ast.AST) -> Val:
        raise NotImplementedError
