"""Whether upstream's code already makes an edit: then `reapply` leaves it out, and
an intent all of whose edits upstream has is `upstreamed`.

Told from the code only: the new statement or condition is there (by syntax tree),
the old expression gave way to the new one, or the target if-chain already has a
branch on the new branch's architecture helper (`is_sm120`, ...).
"""

from __future__ import annotations

import ast
import textwrap

import libcst as cst

from sm120fork.gates import semantics
from sm120fork.gates.model import ARCHS, Arch
from sm120fork.gates.semantics import HELPERS
from sm120fork.intent.archform import needs_no_import
from sm120fork.intent.edits import Missing, alias_name, one
from sm120fork.intent.locate import expressions, statement_matcher, statements
from sm120fork.intent.model import Edit
from sm120fork.intent.source import Source, expression_form, statement_form
from sm120fork.intent.text import first_statement

# ---- Which architectures a gate condition admits, read from its libcst node.
#
# Three-valued: True, False, or None when the answer depends on something that
# is not the architecture. The helpers' meanings come from the gate scanner's
# table (`sm120fork.gates.semantics`), so the two never disagree.

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


def present(source: Source, scope: cst.CSTNode, edit: Edit) -> str:
    """What in upstream's code already makes `edit` ("" when nothing does)."""
    in_scope = [s for s, _, _ in statements(scope)]
    if edit.op == "import_beside":
        names = {
            alias_name(a)
            for s in source.module.body
            if isinstance(s, cst.SimpleStatementLine)
            for small in s.body
            if isinstance(small, cst.ImportFrom) and not isinstance(small.names, cst.ImportStar)
            for a in small.names
        }
        if edit.code in names:
            return f"it imports {edit.code}"
        if edit.target not in names and needs_no_import(source.text, edit.code):
            return f"it tests architectures through get_platform(), {edit.code} is not needed"
        return ""
    if edit.op == "replace":
        old = _replace_count(source, scope, edit.target, outside=edit.code)
        new = _replace_count(source, scope, edit.code)
        return f"`{_first_line(edit.code)}` is there" if not old and new else ""
    if edit.op == "condition":
        match = statement_matcher(f"if {edit.code}")
        hit = any(match(source, s) for s in in_scope)
        return f"a gate tests `{_first_line(edit.code)}`" if hit else _widened(source, scope, edit)
    if edit.op == "add_elif_after":
        return _branch_present(source, scope, edit)
    first = first_statement(edit.code)
    if first is None:
        return ""
    if isinstance(first, ast.FunctionDef | ast.ClassDef):
        pattern = f"{'def' if isinstance(first, ast.FunctionDef) else 'class'} {first.name}"
        match = statement_matcher(pattern)
        return f"it defines {first.name}" if any(match(source, s) for s in in_scope) else ""
    match = statement_matcher(ast.unparse(first))
    hit = any(match(source, s) for s in in_scope)
    return f"`{_first_line(ast.unparse(first))}` is there" if hit else ""


def _branch_present(source: Source, scope: cst.CSTNode, edit: Edit) -> str:
    """A branch of the target's if-chain that already tests the new branch's arch
    (or its condition)."""
    header = edit.code.lstrip().removeprefix("elif").split("\n")[0].rstrip().rstrip(":")
    try:
        test = cst.parse_expression(header.strip())
        target, _, _ = one(source, scope, edit, f"if {edit.target}")
    except (cst.ParserSyntaxError, Missing):
        return ""
    helpers = {helper_name(t) for t in arch_terms(test)}
    wanted = expression_form(header)
    for head, _, _ in statements(scope):
        chain = _chain(head)
        if target not in chain:
            continue
        for branch in chain:
            tested = {helper_name(t) for t in arch_terms(branch.test)}
            code = source.code(branch.test).strip()
            if (helpers and helpers & tested) or source.form(branch.test) == wanted:
                return f"a branch already tests `{code}`"
    return ""


def _chain(node: cst.CSTNode) -> list[cst.If]:
    branches = []
    while isinstance(node, cst.If):
        branches.append(node)
        node = node.orelse  # type: ignore[assignment]
    return branches


def _widened(source: Source, scope: cst.CSTNode, edit: Edit) -> str:
    """A condition edit that lets architectures in (`X` -> `X or is_sm120...`) is made
    when the old gate is gone and a gate in the scope admits those architectures."""
    try:
        one(source, scope, edit, f"if {edit.target}")
        return ""  # the old gate is there: upstream did not change it
    except Missing:
        pass
    old, new = _helpers(edit.target), _helpers(edit.code)
    if not new - old:
        return ""
    archs = [a.name for a in ARCHS if any(HELPERS[h](a) for h in new - old)]
    for statement in statements(scope):
        if isinstance(statement[0], cst.If):
            test = statement[0].test
            if all(admits(test, arch) for arch in archs):
                code = source.code(test).strip()
                return f"upstream's gate `{code}` already admits {', '.join(archs)}"
    return ""


def _helpers(code: str) -> set[str]:
    try:
        expression = cst.parse_expression(f"({textwrap.dedent(code).strip()})")
    except cst.ParserSyntaxError:
        return set()
    names = {helper_name(term) for term in arch_terms(expression)}
    return {name for name in names if name is not None}


def _replace_count(source: Source, scope: cst.CSTNode, code: str, outside: str = "") -> int:
    """Occurrences of `code` in the scope, not counting those inside `outside`'s (the new
    choice often keeps the old one: `("triton" if is_sm120 else "fa3")`)."""
    if expression_form(code) is not None:
        found = expressions(scope, code, source)
        if outside and expression_form(outside) is not None:
            kept = expressions(scope, outside, source)
            inside = sum(len(expressions(node, code, source)) for node in kept)
            return len(found) - inside
        return len(found)
    wanted = statement_form(code)
    return sum(source.form(s) == wanted for s, _, _ in statements(scope))


def _first_line(code: str) -> str:
    return textwrap.dedent(code).strip().split("\n")[0]
