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

from sm120fork.gates.model import ARCHS
from sm120fork.gates.semantics import HELPERS
from sm120fork.intent import archexpr
from sm120fork.intent.archform import needs_no_import
from sm120fork.intent.edits import Missing, alias_name, one
from sm120fork.intent.locate import expressions, statement_matcher, statements
from sm120fork.intent.model import Edit
from sm120fork.intent.source import Source, expression_form, statement_form
from sm120fork.intent.text import first_statement


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
    helpers = {archexpr.helper_name(t) for t in archexpr.arch_terms(test)}
    wanted = expression_form(header)
    for head, _, _ in statements(scope):
        chain = _chain(head)
        if target not in chain:
            continue
        for branch in chain:
            tested = {archexpr.helper_name(t) for t in archexpr.arch_terms(branch.test)}
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
            if all(archexpr.admits(test, arch) for arch in archs):
                code = source.code(test).strip()
                return f"upstream's gate `{code}` already admits {', '.join(archs)}"
    return ""


def _helpers(code: str) -> set[str]:
    try:
        expression = cst.parse_expression(f"({textwrap.dedent(code).strip()})")
    except cst.ParserSyntaxError:
        return set()
    names = {archexpr.helper_name(term) for term in archexpr.arch_terms(expression)}
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
