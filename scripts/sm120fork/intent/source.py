"""One module's source parsed for an intent: its libcst tree (with the functions that
cannot hold the intent's edits as skeletons), its ast, and the positions of the
code an edit looks at, worked out per unit and checked against the file's lines,
so an edit is spliced into the text where the file has it.
"""

from __future__ import annotations

import ast
import bisect
import textwrap
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import libcst as cst
from libcst.metadata import MetadataWrapper, PositionProvider

from sm120fork.intent.archform import canonical, platform_aliases
from sm120fork.intent.freenames import first_line

Span = tuple[int, int, int, int]  # start line, start column, end line, end column


@dataclass
class Source:
    """One parsed module, with positions to edit its text in place.

    Positions are worked out per unit, when an edit first looks inside it
    (`focus`): a top-level statement, or one statement of a top-level class (a
    method of ServerArgs, not the whole 5000-line class). For a large module they
    cost more than the parse, and an intent looks at a few functions."""

    path: str
    text: str
    module: cst.Module
    tree: ast.Module
    tops: dict[cst.CSTNode, int]  # top-level statement -> the line its code starts on
    members: dict[cst.CSTNode, tuple[int, cst.CSTNode]]  # class statement -> (line, class)
    line_starts: list[int] = field(default_factory=list)
    # Units not parsed as the file has them: a function with `...` as its body, a class
    # holding one; `focus` refuses them.
    stubbed: frozenset[int] = frozenset()
    positions: dict[cst.CSTNode, Span] = field(default_factory=dict)
    _focused: set[int] = field(default_factory=set)
    _forms: dict[int, str | None] = field(default_factory=dict)
    _aliases: frozenset[str] | None = None

    @classmethod
    def parse(cls, path: str, text: str, keep: frozenset[str] | None = None) -> Source | None:
        """`text` parsed; with `keep`, only the functions whose text names one of `keep`
        are parsed whole, the others with their body as `...` (`_skeleton`): libcst
        builds a node for every token, and ServerArgs' 8000 lines took a second a
        parse, once per patch of a rebase."""
        try:
            tree = ast.parse(text)
            skeleton, stubs = _skeleton(text, tree, keep) if keep is not None else (text, set())
            module = cst.parse_module(skeleton)
        except (cst.ParserSyntaxError, SyntaxError, ValueError):
            return None
        top_starts = _starts(module.body, tree.body)
        if top_starts is None:
            return None
        tops = {statement: line for statement, _, line in top_starts}
        stubbed = {id(statement) for statement, node, _ in top_starts if id(node) in stubs}
        members: dict[cst.CSTNode, tuple[int, cst.CSTNode]] = {}
        for statement, node, _ in top_starts:
            body = getattr(statement, "body", None)
            if isinstance(statement, cst.ClassDef) and isinstance(body, cst.IndentedBlock):
                assert isinstance(node, ast.ClassDef)
                for member, inner, at in _starts(body.body, node.body) or []:
                    members[member] = (at, statement)
                    if id(inner) in stubs:
                        stubbed |= {id(member), id(statement)}
        starts = [0]
        for line in text.split("\n"):
            starts.append(starts[-1] + len(line) + 1)
        return cls(path, text, module, tree, tops, members, starts, frozenset(stubbed))

    def is_unit(self, node: cst.CSTNode) -> bool:
        """Whether `focus` takes `node` (a top-level statement or a class's statement)."""
        return node in self.tops or node in self.members

    def focus(self, unit: cst.CSTNode) -> None:
        """Positions for everything inside `unit` (see `is_unit`)."""
        if id(unit) in self._focused:
            return
        if id(unit) in self.stubbed:
            raise ValueError(f"{self.path}: asked for positions in code not parsed")
        self._focused.add(id(unit))
        alone = cst.Module(
            body=[unit],  # type: ignore[list-item]
            default_indent=self.module.default_indent,
            default_newline=self.module.default_newline,
        )
        if unit in self.tops:  # rendered alone exactly as the file has it
            first, columns = self.tops[unit], None
        else:
            first, owner = self.members[unit]
            columns = self._indents(alone.code, first)
            if columns is None:  # not rendered as the file has it: the whole class
                self._focused.discard(id(unit))
                self.focus(owner)  # (which a skeleton refuses: it is not the file's)
                return
        shift = first - 1
        for node, where in (
            MetadataWrapper(alone, unsafe_skip_copy=True).resolve(PositionProvider).items()
        ):
            start, end = where.start, where.end
            into, out_of = (
                (0, 0) if columns is None else (columns[start.line - 1], columns[end.line - 1])
            )
            self.positions[node] = (
                start.line + shift,
                start.column + into,
                end.line + shift,
                end.column + out_of,
            )

    def _indents(self, rendered: str, first: int) -> list[int] | None:
        """Per line of a class statement rendered alone, what the file has before it (the
        class's indentation, or nothing on a string's continuation line); None if a
        line is not the file's line with its indentation taken off."""
        *lines, last = rendered.split("\n")
        columns = []
        for number, line in enumerate([*lines, *([last] if last else [])], start=first):
            start, end = self.offset(number), self.offset(number + 1)
            held = self.text[start:end].rstrip("\n") if number < len(self.line_starts) else ""
            if not held.endswith(line) or held[: len(held) - len(line)].strip():
                return None
            columns.append(len(held) - len(line))
        return [*columns, 0]  # the line after it, where nothing of it starts

    def span(self, node: cst.CSTNode) -> Span:
        """(start line, start column, end line, end column), lines from 1; `node` is a
        top-level statement or inside one that was focused."""
        if node not in self.positions and self.is_unit(node):
            self.focus(node)
        return self.positions[node]

    def line_of(self, offset: int) -> int:
        return bisect.bisect_right(self.line_starts, offset)

    def offset(self, line: int, column: int = 0) -> int:
        return self.line_starts[min(line - 1, len(self.line_starts) - 1)] + column

    def indent(self, line: int) -> str:
        text = self.text[self.offset(line) : self.offset(line + 1)]
        return text[: len(text) - len(text.lstrip(" \t"))]

    def code(self, node: cst.CSTNode) -> str:
        return self.module.code_for_node(node)

    def form(self, node: cst.CSTNode) -> str | None:
        """The syntax tree of a statement or expression (cached: scopes are searched
        once per edit, and again to tell what upstream already has)."""
        key = id(node)
        if key not in self._forms:
            code = self.code(node)
            is_expression = isinstance(node, cst.BaseExpression)
            aliases = self.aliases
            self._forms[key] = (
                expression_form(code, aliases) if is_expression else statement_form(code, aliases)
            )
        return self._forms[key]

    @property
    def aliases(self) -> frozenset[str]:
        """The names this module binds to `get_platform()`."""
        if self._aliases is None:
            self._aliases = platform_aliases(self.tree)
        return self._aliases


_PARSED: OrderedDict[tuple[str, str, frozenset[str] | None], Source | None] = OrderedDict()
_KEPT = 24  # modules: a rebase re-reads the same few (server_args.py is 40 MB parsed)


def parsed(path: str, text: str, keep: frozenset[str] | None = None) -> Source | None:
    """`Source.parse`, once per module text (and `keep`) in a process: a rebase
    re-applies each patch's intent, and `check` each intent, to mostly the same
    unchanged modules."""
    key = (path, text, keep)
    if key in _PARSED:
        _PARSED.move_to_end(key)
        return _PARSED[key]
    source = _PARSED[key] = Source.parse(path, text, keep)
    while len(_PARSED) > _KEPT:
        _PARSED.popitem(last=False)
    return source


def _statements_of(body: Iterable[cst.CSTNode], nodes: list[ast.stmt]) -> list[ast.stmt]:
    """The first ast statement of each libcst statement (a line `a = 1; b = 2` is one
    libcst statement and two ast ones)."""
    found: list[ast.stmt] = []
    index = 0
    for statement in body:
        if index >= len(nodes):
            break
        found.append(nodes[index])
        index += len(statement.body) if isinstance(statement, cst.SimpleStatementLine) else 1
    return found


def _starts(
    body: Sequence[cst.CSTNode], nodes: list[ast.stmt]
) -> list[tuple[cst.CSTNode, ast.stmt, int]] | None:
    """Each statement of a libcst body, the ast statement it begins with, and the line its
    leading comments start on; None if the two bodies do not line up."""
    firsts = _statements_of(body, nodes)
    if len(firsts) != len(body):
        return None
    starts = []
    for statement, node in zip(body, firsts, strict=True):
        line = min([node.lineno, *(d.lineno for d in getattr(node, "decorator_list", []))])
        starts.append((statement, node, line - len(getattr(statement, "leading_lines", ()))))
    return starts


def _skeleton(text: str, tree: ast.Module, keep: frozenset[str]) -> tuple[str, set[int]]:
    """`text` with the body of each top-level function and class method that names none
    of `keep` replaced by one `...` line, and the ids of those functions' ast nodes.
    Only lines of bodies change, so every statement around them is the same, and
    their order; positions come from the file's own lines (Source.focus checks)."""
    if "\r" in text:
        return text, set()
    lines = text.split("\n")
    cuts: list[tuple[int, int, str]] = []
    stubs: set[int] = set()
    units = [*tree.body]
    units += [m for node in tree.body if isinstance(node, ast.ClassDef) for m in node.body]
    for node in units:
        if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) or not node.end_lineno:
            continue
        first = node.body[0]
        line = lines[first.lineno - 1]
        if first.lineno == node.lineno or line[: first.col_offset].strip():
            continue  # the body starts on a line of the header
        unit = "\n".join(lines[first_line(node) - 1 : node.end_lineno])
        if any(name in unit for name in keep):
            continue
        cuts.append((first.lineno - 1, node.end_lineno - 1, line[: first.col_offset]))
        stubs.add(id(node))
    for start, end, indent in sorted(cuts, reverse=True):
        lines[start : end + 1] = [f"{indent}..."]
    return "\n".join(lines), stubs


def expression_form(code: str, aliases: frozenset[str] = frozenset()) -> str | None:
    """The syntax tree of an expression (arch tests in one spelling), or None if `code`
    is not one (`aliases`: the names its module binds to `get_platform()`)."""
    try:
        return ast.dump(canonical(ast.parse(f"(\n{code}\n)", mode="eval").body, aliases))
    except SyntaxError:
        return None


def statement_form(code: str, aliases: frozenset[str] = frozenset()) -> str | None:
    try:
        tree = ast.parse(textwrap.dedent(code).strip("\n") + "\n")
        return ast.dump(canonical(tree, aliases))
    except SyntaxError:
        return None
