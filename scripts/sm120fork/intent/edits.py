"""An edit as text splices on the located code, and whether upstream already has it.

The code is found with libcst (locate.py) and changed as text at the located
span, so everything around it keeps its bytes: what `check` needs to prove an
intent reproduces its patch exactly. New code is written at column 0 in the
intent and indented to where it lands.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass, replace

import libcst as cst

from sm120fork.intent import passform
from sm120fork.intent.archform import spelled_for
from sm120fork.intent.freenames import unbound
from sm120fork.intent.locate import Block, expressions, statement_matcher, statements
from sm120fork.intent.model import Edit
from sm120fork.intent.source import Source, expression_form
from sm120fork.intent.text import (
    blank_lines,
    block_text,
    first_statement,
    inline_text,
    raises,
    trailing_comments,
)


class Missing(Exception):
    """The edit's anchor is not in its scope (or is there more than once), or it is
    (`anchored`) but the new code cannot run there."""

    def __init__(self, message: str, *, anchored: bool = False) -> None:
        super().__init__(message)
        self.anchored = anchored


@dataclass(frozen=True, order=True)
class Splice:
    start: int
    end: int
    order: int  # zero-width splices at one offset keep the intent's order
    text: str


Found = tuple[cst.BaseStatement, Block, int]


def one(source: Source, scope: cst.CSTNode, edit: Edit, pattern: str) -> Found:
    match = statement_matcher(pattern)
    holding = statement_matcher(edit.holding) if edit.holding else None
    found = [
        item
        for item in statements(scope)
        if match(source, item[0])
        and (holding is None or any(holding(source, s) for s, _, _ in statements(item[0])))
    ]
    if len(found) != 1:
        many = f"{len(found)} statements" if found else "no statement"
        raise Missing(f"{many} `{pattern.strip()}` in {edit.where()}")
    return found[0]


def _separated(code: str, edit: Edit | None) -> bool:
    """Whether new code is set off by blank lines as its neighbours are: a definition
    always, other code when the edit asks (`paragraph`); else it joins the anchor's."""
    first = first_statement(code)
    return isinstance(first, ast.FunctionDef | ast.ClassDef) or bool(edit and edit.paragraph)


def _after(source: Source, found: Found, code: str, order: int, edit: Edit | None) -> Splice:
    statement, block, index = found
    line = source.span(statement)[2] + 1
    following = block.body[index + 1] if 0 <= index < len(block.body) - 1 else None
    # The last statement of a block: a paragraph is set off by one blank line.
    blanks = blank_lines(getattr(following, "leading_lines", ())) if following is not None else 1
    blanks = blanks if _separated(code, edit) else 0
    indent = source.indent(source.span(statement)[0])
    at = source.offset(line)
    return Splice(at, at, order, "\n" * blanks + block_text(code, indent))


def _before(source: Source, found: Found, code: str, order: int, edit: Edit | None) -> Splice:
    statement, _, index = found
    if index < 0:
        raise Missing("cannot insert before an elif branch")
    first = statement
    decorators = getattr(statement, "decorators", ())
    source.span(first)  # a top-level statement's positions come with its first span
    line = source.span(decorators[0] if decorators else first)[0]
    leading = list(getattr(statement, "leading_lines", ()))
    comments = trailing_comments(leading)
    blanks = blank_lines(list(reversed(leading[: len(leading) - comments])))
    blanks = blanks if _separated(code, edit) else 0
    at = source.offset(line - comments)
    return Splice(at, at, order, block_text(code, source.indent(line)) + "\n" * blanks)


def _top(source: Source, scope: cst.CSTNode, edit: Edit, order: int) -> Splice:
    body = getattr(scope, "body", None)
    block = body if isinstance(body, cst.IndentedBlock) else scope
    if not isinstance(block, cst.IndentedBlock) or not block.body:
        raise Missing("the scope has no indented body")
    if edit.target == "end":
        return _after(source, (block.body[-1], block, len(block.body) - 1), edit.code, order, edit)
    first = block.body[0]
    docstring = (
        isinstance(first, cst.SimpleStatementLine)
        and isinstance(first.body[0], cst.Expr)
        and isinstance(first.body[0].value, cst.SimpleString | cst.ConcatenatedString)
    )
    if docstring:
        return _after(source, (first, block, 0), edit.code, order, edit)
    return _before(source, (first, block, 0), edit.code, order, edit)


@dataclass(frozen=True)
class Plan:
    splices: list[Splice]
    note: str = ""  # how the code was adapted to where it lands ("" as written)


def plan(
    source: Source, scope: cst.CSTNode, edit: Edit, order: int, introduced: frozenset[str]
) -> Plan:
    """The splices that make `edit` in `source`; Missing when its anchor is not there, or
    when its new code reads a name nothing there binds (`introduced`: what the
    intent's other edits add). Code written for a ServerArgs method that lands in an
    override pass is rewritten in the pass's form (passform.py)."""
    if edit.op in ("import_beside", "comment_after"):
        return Plan(_plan(source, scope, edit, order))
    edit = replace(edit, code=spelled_for(source.text, edit.code))
    splices = _plan(source, scope, edit, order)
    # Where the code lands: inside the scope's function, or at module level.
    inside = not isinstance(scope, cst.Module)
    line = source.span(scope)[0] if inside else source.line_of(splices[0].start)
    names = unbound(source.tree, line, edit.code, set(introduced))
    note = ""
    if "self" in names:
        form = passform.rewrite(source.tree, line, edit.code)
        if form.code is None:
            lacks = f"its new code reads self, which {edit.where()} lacks, and {form.note}"
            raise Missing(lacks, anchored=True)
        edit, note = replace(edit, code=form.code), form.note
        splices = _plan(source, scope, edit, order)
        names = unbound(source.tree, line, edit.code, set(introduced))
    if names:
        lacks = f"its new code reads {', '.join(names)}, which {edit.where()} lacks"
        raise Missing(lacks, anchored=True)
    return Plan(splices, note)


def _plan(source: Source, scope: cst.CSTNode, edit: Edit, order: int) -> list[Splice]:
    op = edit.op
    if op.startswith("refuse") and not raises(edit.code):
        raise Missing(f"`{op}` code must raise (a refusal)")
    if op == "add_branch_before":
        return _branch_before(source, scope, edit, order)
    if op == "comment_after":
        return [_comment_after(source, scope, edit, order)]
    if op.endswith("_at"):
        return [_top(source, scope, edit, order)]
    if op in ("insert_after", "refuse_after"):
        found = one(source, scope, edit, edit.target)
        return [_after(source, found, edit.code, order, edit)]
    if op in ("insert_before", "refuse_before"):
        found = one(source, scope, edit, edit.target)
        return [_before(source, found, edit.code, order, edit)]
    if op == "add_elif_after":
        branch, _, _ = one(source, scope, edit, f"if {edit.target}")
        assert isinstance(branch, cst.If)
        if not edit.code.lstrip().startswith("elif "):
            raise Missing("`add_elif_after` code must start with `elif`")
        at = source.offset(source.span(branch.body)[2] + 1)
        text = block_text(edit.code, source.indent(source.span(branch)[0]))
        return [Splice(at, at, order, text)]
    if op == "condition":
        branch, _, _ = one(source, scope, edit, f"if {edit.target}")
        assert isinstance(branch, cst.If)
        line, column, end_line, end_column = source.span(branch.test)
        indent = source.indent(line)
        splices = [
            Splice(
                source.offset(line, column),
                source.offset(end_line, end_column),
                order,
                inline_text(edit.code, indent),
            )
        ]
        if edit.comment:
            at = source.offset(source.span(branch)[0])
            splices.append(Splice(at, at, order, block_text(edit.comment, indent)))
        return splices
    if op == "replace":
        return _replace(source, scope, edit, order)
    return [_import(source, edit, order)]


def _branch_before(source: Source, scope: cst.CSTNode, edit: Edit, order: int) -> list[Splice]:
    """A new branch before the one testing `target`: an `if` target becomes `elif`."""
    branch, _, index = one(source, scope, edit, f"if {edit.target}")
    if not edit.code.lstrip().startswith("if "):
        raise Missing("`add_branch_before` code must start with `if`")
    line, column = source.span(branch)[:2]
    at = source.offset(line)
    code = edit.code
    if index < 0:  # before an elif: the new branch is an elif too
        return [Splice(at, at, order, block_text(f"el{code.lstrip()}", source.indent(line)))]
    keyword = source.offset(line, column)
    return [
        Splice(at, at, order, block_text(code, source.indent(line))),
        Splice(keyword, keyword + 2, order, "elif"),
    ]


def _comment_after(source: Source, scope: cst.CSTNode, edit: Edit, order: int) -> Splice:
    """Comment lines after the scope's one comment line that reads `target`."""
    first, _, last, _ = source.span(scope)
    wanted = edit.target.strip()
    lines = [n for n in range(first, last + 1) if _line(source, n).strip() == wanted]
    if len(lines) != 1:
        raise Missing(f"{len(lines)} comment lines `{wanted}` in {edit.where()}")
    at = source.offset(lines[0] + 1)
    return Splice(at, at, order, block_text(edit.code, source.indent(lines[0])))


def _line(source: Source, number: int) -> str:
    return source.text[source.offset(number) : source.offset(number + 1)]


def _replace(source: Source, scope: cst.CSTNode, edit: Edit, order: int) -> list[Splice]:
    if expression_form(edit.target) is not None:
        nodes: list[cst.CSTNode] = list(expressions(scope, edit.target, source))
    else:
        match = statement_matcher(edit.target)
        nodes = [s for s, _, _ in statements(scope) if match(source, s)]
    if not nodes or (edit.count and len(nodes) != edit.count):
        raise Missing(f"{len(nodes)} occurrences of `{edit.target.strip()}` in {edit.where()}")
    splices = []
    for node in nodes:
        line, column, end_line, end_column = source.span(node)
        text = inline_text(edit.code, source.indent(line))
        start, end = source.offset(line, column), source.offset(end_line, end_column)
        splices.append(Splice(start, end, order, text))
    return splices


def _import(source: Source, edit: Edit, order: int) -> Splice:
    aliases = [
        (statement, alias)
        for statement in source.module.body
        if isinstance(statement, cst.SimpleStatementLine)
        for small in statement.body
        if isinstance(small, cst.ImportFrom) and not isinstance(small.names, cst.ImportStar)
        for alias in small.names
        if alias_name(alias) == edit.target
    ]
    if len(aliases) != 1:
        raise Missing(f"{len(aliases)} imports of {edit.target} in {edit.where()}")
    statement, alias = aliases[0]
    source.focus(statement)
    line, _, _, end_column = source.span(alias.name)
    if line != source.span(statement)[0] and isinstance(alias.comma, cst.Comma):
        at = source.offset(line + 1)
        return Splice(at, at, order, f"{source.indent(line)}{edit.code},\n")
    at = source.offset(*source.span(alias)[2:]) if alias.asname else source.offset(line, end_column)
    return Splice(at, at, order, f", {edit.code}")


def alias_name(alias: cst.ImportAlias) -> str:
    if alias.asname is not None and isinstance(alias.asname.name, cst.Name):
        return alias.asname.name.value
    return cst.Module(body=()).code_for_node(alias.name)
