"""Text of new code: dedented and indented where it lands, blank lines counted, and
what the code is (its first statement, whether it raises)."""

from __future__ import annotations

import ast
import textwrap

import libcst as cst


def block_text(code: str, indent: str) -> str:
    lines = textwrap.dedent(code).strip("\n").split("\n")
    return "".join(f"{indent}{line}\n" if line.strip() else "\n" for line in lines)


def inline_text(code: str, indent: str) -> str:
    """`code` at a position inside a line: its later lines follow that line's indent."""
    first, *rest = textwrap.dedent(code).strip("\n").split("\n")
    return "\n".join([first, *(f"{indent}{line}" if line.strip() else "" for line in rest)])


def blank_lines(lines: tuple[cst.EmptyLine, ...] | list[cst.EmptyLine]) -> int:
    count = 0
    for line in lines:
        if line.comment is not None:
            break
        count += 1
    return count


def trailing_comments(leading: list[cst.EmptyLine]) -> int:
    count = 0
    for line in reversed(leading):
        if line.comment is None:
            break
        count += 1
    return count


def raises(code: str) -> bool:
    try:
        tree = ast.parse(textwrap.dedent(code).strip("\n"))
    except SyntaxError:
        return False
    return any(isinstance(node, ast.Raise) for node in ast.walk(tree))


def first_statement(code: str) -> ast.stmt | None:
    try:
        body = ast.parse(textwrap.dedent(code).strip("\n")).body
    except SyntaxError:
        return None
    return body[0] if body else None
