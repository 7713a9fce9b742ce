"""The abstract values the evaluator computes, and what other modules export.

A `Val` is either known (`deps` empty: `value` is what Python would compute
on that architecture) or unknown (`deps` names what it still depends on:
syntax nodes of this module, or text from another module). `arch` says the
value was derived from the GPU architecture, `test` that it is a boolean
architecture test (a helper's answer, a comparison, ...), `fact` that a known
value follows from the platform (CUDA) or the architecture, so it may be
carried through a variable.
"""

from __future__ import annotations

import ast
from collections.abc import Iterable
from dataclasses import dataclass, field

from sm120fork.gates.answer import Answer
from sm120fork.gates.scopes import FunctionNode, Scope

Dep = ast.AST | str
# A dependency naming an exception: evaluating the condition raises on that architecture.
RAISES = "\x00raises "


@dataclass(frozen=True, slots=True)
class Val:
    value: object = None
    deps: frozenset[Dep] = frozenset()
    arch: bool = False
    test: bool = False
    fact: bool = False

    @property
    def known(self) -> bool:
        return not self.deps


def unknown(deps: Iterable[Dep], *, arch: bool = False, test: bool = False) -> Val:
    return Val(None, frozenset(deps), arch, test)


# Symbolic values: callables, modules and the platform object. Python
# operators on them are not computed; they stand for what they name.
class Symbol:
    __slots__ = ()


@dataclass(frozen=True)
class HelperFn(Symbol):
    name: str
    method: bool  # called on an object (platform class), not a module


@dataclass(frozen=True)
class ProbeFn(Symbol):
    value: bool  # is_cuda() and friends


@dataclass(frozen=True)
class SourceFn(Symbol):
    kind: str  # capability, sm, has_capability, platform


@dataclass(frozen=True)
class BuiltinFn(Symbol):
    name: str


@dataclass(frozen=True)
class BoundMethod(Symbol):
    obj: object
    name: str


@dataclass(frozen=True)
class ModuleRef(Symbol):
    name: str


@dataclass(frozen=True)
class PlatformObj(Symbol):
    pass


@dataclass(frozen=True, eq=False)
class LocalFn(Symbol):
    node: FunctionNode
    scope: Scope  # where it is defined
    bound: bool  # reached through self./cls.: the first parameter is supplied


@dataclass(frozen=True)
class ExternalFn(Symbol):
    """A zero-argument function of another module, by its per-arch results."""

    results: tuple[Val, ...]


PLATFORM = PlatformObj()


def concrete(val: Val) -> bool:
    return val.known and not isinstance(val.value, Symbol)


def truth(val: Val) -> bool | None:
    """Three-valued truthiness: None when unknown."""
    if not concrete(val):
        return None
    try:
        return bool(val.value)
    except Exception:  # a value whose truth Python would not decide here
        return None


@dataclass(frozen=True)
class Export:
    """A module-level name derived from the architecture, per ARCHS index."""

    values: tuple[Val, ...]


# (module, name) -> Export
ExportTable = dict[tuple[str, str], Export]

# A class of the tree: (module, qualified name).
ClassRef = tuple[str, str]
# What one call passes: (slot, the value per ARCHS index); the slot is the
# position ("0", "1", ...) or the keyword; "*" / "**" stand for unpacked arguments.
CallArgs = tuple[tuple[str, tuple[Val, ...]], ...]


@dataclass(frozen=True)
class ClassFacts:
    """A class as its own module saw it: for the classes related to it elsewhere."""

    bases: tuple[ClassRef, ...]  # its bases that are classes of the tree
    sets: frozenset[str]  # the attributes it assigns (self.x = ..., class-level names)
    attrs: dict[str, Export] = field(default_factory=dict)  # those derived from the architecture


@dataclass
class DepText:
    """Renders dependencies (syntax nodes) as short source text, cached."""

    cache: dict[int, str] = field(default_factory=dict)

    def __call__(self, dep: Dep) -> str:
        if isinstance(dep, str):
            return dep
        key = id(dep)
        text = self.cache.get(key)
        if text is None:
            text = ast.unparse(dep)
            if len(text) > 80:
                text = text[:77] + "..."
            self.cache[key] = text
        return text

    def render(self, val: Val, condition: str) -> Answer:
        if val.deps:
            texts = sorted({self(d) for d in val.deps})
            raised = [t[len(RAISES) :] for t in texts if t.startswith(RAISES)]
            if raised:  # e.g. a per-major table without this major
                return Answer.raises(", ".join(raised))
            return Answer.depends(", ".join(texts))
        answer = truth(val)
        if answer is None:
            return Answer.depends(condition)
        return Answer.of(answer)

    def portable(self, val: Val) -> Val:
        """The same value with its dependencies as text (to cross processes)."""
        value = val.value
        if isinstance(value, LocalFn):  # only meaningful in its own module
            value = None
        deps = frozenset(self(d) for d in val.deps)
        return Val(value, deps, val.arch, val.test, val.fact)
