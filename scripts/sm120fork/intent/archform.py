"""One architecture test, several spellings: `is_sm100_supported()`, a cached
`_is_sm100_supported`, `utils.is_sm100_supported()` and 0.5.19's
`get_platform().is_sm100` are the same test (the gate scanner's table,
`sm120fork.gates.semantics`). Patterns match across spellings, and an intent's new
code is written in the spelling of the module it lands in.
"""

from __future__ import annotations

import ast
import re

from sm120fork.gates import semantics

_FACT_OF = semantics.HELPER_FACTS  # helper -> the get_platform() fact for it
_PROBES = set(semantics.PLATFORM_PROBES)


def _is_platform(node: ast.AST, aliases: frozenset[str]) -> bool:
    """`get_platform()`, or a name the module binds to it (`platform = get_platform()`)."""
    if isinstance(node, ast.Name):
        return node.id in aliases
    return (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Name)
        and node.func.id in semantics.PLATFORM_GETTERS
        and not node.args
    )


def platform_aliases(tree: ast.AST) -> frozenset[str]:
    """The names a module binds to `get_platform()` (a local of any of its functions:
    upstream binds one where a branch tests several facts)."""
    return frozenset(
        node.targets[0].id
        for node in ast.walk(tree)
        if isinstance(node, ast.Assign)
        and len(node.targets) == 1
        and isinstance(node.targets[0], ast.Name)
        and _is_platform(node.value, frozenset())
    )


def _platform_attribute(node: ast.AST, aliases: frozenset[str] = frozenset()) -> str | None:
    if isinstance(node, ast.Attribute) and _is_platform(node.value, aliases):
        return node.attr
    return None


def _canonical(node: ast.AST, aliases: frozenset[str]) -> str | None:
    """The one name an arch or platform term gets, whatever its spelling."""
    if isinstance(node, ast.Call) and not node.args and not node.keywords:
        func = node.func
        name = func.id if isinstance(func, ast.Name) else None
        name = func.attr if isinstance(func, ast.Attribute) else name
        if name in semantics.HELPERS or name in _PROBES:
            return f"__{name}__"
        if name in semantics.SM_FUNCS:
            return "__sm__"
    if isinstance(node, ast.Name) and node.id.lstrip("_") in semantics.HELPERS:
        return f"__{node.id.lstrip('_')}__"
    fact = _platform_attribute(node, aliases)
    if fact in semantics.PLATFORM_FACTS:
        return f"__{semantics.PLATFORM_FACTS[fact]}__"
    if fact in _PROBES:
        return f"__{fact}__"
    if fact == "device_sm":
        return "__sm__"
    return None


class _Canonical(ast.NodeTransformer):
    def __init__(self, aliases: frozenset[str]) -> None:
        self.aliases = aliases

    def visit(self, node: ast.AST) -> ast.AST:
        name = _canonical(node, self.aliases)
        if name is not None:
            return ast.Name(id=name, ctx=ast.Load())
        visited: ast.AST = super().visit(node)
        return visited


def canonical(tree: ast.AST, aliases: frozenset[str] = frozenset()) -> ast.AST:
    """`tree` with every arch or platform term in one spelling (`aliases`: the names the
    module binds to `get_platform()`)."""
    result: ast.AST = _Canonical(aliases).visit(tree)
    return result


_CALL = re.compile(r"\b(is_\w+|get_device_sm)\(\)")


def spelled_for(text: str, code: str) -> str:
    """`code` with each helper call the module `text` never names written as the
    module's `get_platform()` fact, when the module tests through `get_platform()`."""
    if "get_platform" not in text:
        return code

    def spell(match: re.Match[str]) -> str:
        name = match.group(1)
        if re.search(rf"(?<![.\w]){name}\b", text):  # the module has it as a function
            return match.group(0)
        if name in _FACT_OF:
            return f"get_platform().{_FACT_OF[name]}"
        if name in _PROBES:
            return f"get_platform().{name}"
        if name == "get_device_sm":
            return "get_platform().device_sm"
        return match.group(0)

    return _CALL.sub(spell, code)


def needs_no_import(text: str, name: str) -> bool:
    """Whether a module that tests through `get_platform()` would get `name` spelled as
    a platform fact (so importing the helper is not part of the change there)."""
    return spelled_for(text, f"{name}()") != f"{name}()"
