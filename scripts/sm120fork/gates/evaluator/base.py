"""The evaluator's shape: the state its parts (`names`, `operators`, `evaluate`)
share, and the methods each part calls on the others.

`Evaluator` (in `evaluate`) is `Names` + `Operators` over this base; `functions`
and `external` take any `EvaluatorBase`, so that no part imports the whole.
"""

from __future__ import annotations

import ast
from abc import ABC, abstractmethod

from sm120fork.gates.evaluator.context import Context
from sm120fork.gates.hot import Hotness
from sm120fork.gates.model import Arch
from sm120fork.gates.scopes import Binding, ModuleScopes, Scope
from sm120fork.gates.values import Val


class EvaluatorBase(ABC):
    """The state and the methods the evaluator's parts rely on each other for."""

    scopes: ModuleScopes
    arch: Arch
    context: Context
    index: int  # the architecture's position in ARCHS (for other modules' exports)
    memo: dict[int, Val]
    active: set[int]
    unknown_helpers: set[str]
    hotness: Hotness | None  # None: consider every parameter and call

    @abstractmethod
    def eval(self, node: ast.AST, scope: Scope) -> Val:
        """The value of `node` (in `evaluate`)."""

    @abstractmethod
    def from_bindings(self, bindings: list[Binding], node: ast.AST, *, every: bool = False) -> Val:
        """The value bindings give a name (in `names`)."""

    @abstractmethod
    def _item(self, base: Val, index: Val, node: ast.AST) -> Val:
        """`base[index]` (in `operators`)."""
