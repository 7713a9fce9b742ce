"""Which architectures a gate condition admits, read from its libcst node.

Three-valued: True, False, or None when the answer depends on something that
is not the architecture. The helpers' meanings come from the gate scanner's
table (`sm120fork.gates.semantics`), so the two never disagree.
"""

from __future__ import annotations

import libcst as cst

from sm120fork.gates import semantics
from sm120fork.gates.model import ARCHS, Arch

ARCH_BY_NAME = {arch.name: arch for arch in ARCHS}


def helper_name(node: cst.BaseExpression) -> str | None:
    """The helper an arch term stands for: `is_sm100_supported()`, `_is_sm100_supported`,
    `utils.is_sm100_supported()`, `get_platform().is_sm100`."""
    if isinstance(node, cst.Call):
        func = node.func
        if isinstance(func, cst.Name):
            return func.value if func.value in semantics.HELPERS else None
        if isinstance(func, cst.Attribute):
            return func.attr.value if func.attr.value in semantics.HELPERS else None
        return None
    if isinstance(node, cst.Name):
        name = node.value.lstrip("_")
        return name if name in semantics.HELPERS else None
    if isinstance(node, cst.Attribute) and node.attr.value in semantics.PLATFORM_FACTS:
        value = node.value
        if (
            isinstance(value, cst.Call)
            and isinstance(value.func, cst.Name)
            and value.func.value in semantics.PLATFORM_GETTERS
        ):
            return semantics.PLATFORM_FACTS[node.attr.value]
    return None


def admits(node: cst.BaseExpression, arch_name: str) -> bool | None:
    arch = ARCH_BY_NAME[arch_name]
    return _evaluate(node, arch)


def _evaluate(node: cst.BaseExpression, arch: Arch) -> bool | None:
    helper = helper_name(node)
    if helper is not None:
        return semantics.HELPERS[helper](arch)
    if isinstance(node, cst.UnaryOperation) and isinstance(node.operator, cst.Not):
        inner = _evaluate(node.expression, arch)
        return None if inner is None else not inner
    if isinstance(node, cst.BooleanOperation):
        left, right = _evaluate(node.left, arch), _evaluate(node.right, arch)
        if isinstance(node.operator, cst.And):
            if left is False or right is False:
                return False
            return True if left and right else None
        if left is True or right is True:
            return True
        return False if left is False and right is False else None
    return None


def arch_terms(node: cst.BaseExpression) -> list[cst.BaseExpression]:
    """Every arch term inside a condition, outermost first."""
    found: list[cst.BaseExpression] = []

    class Collector(cst.CSTVisitor):
        def on_visit(self, visited: cst.CSTNode) -> bool:
            if isinstance(visited, cst.BaseExpression) and helper_name(visited) is not None:
                found.append(visited)
                return False
            return True

    node.visit(Collector())
    return found
