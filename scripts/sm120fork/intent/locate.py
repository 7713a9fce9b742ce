"""Find an edit's code by meaning: scopes by name or registration, statements and
expressions by their syntax tree (so line wrapping, parentheses and quotes do not
matter), in whichever module the code lives now.
"""

from __future__ import annotations

import textwrap
from collections.abc import Callable, Iterable, Iterator

import libcst as cst

from sm120fork.intent.model import Edit
from sm120fork.intent.source import Source, expression_form, statement_form

Block = cst.Module | cst.IndentedBlock


HEADERS = ("if", "elif", "def", "class")


def statement_matcher(pattern: str) -> Callable[[Source, cst.CSTNode], bool]:
    """`if COND` / `elif COND` (the test), `def NAME` / `class NAME`, or a whole statement."""
    keyword, _, rest = pattern.strip().rstrip(":").partition(" ")
    if keyword in ("def", "class"):
        definition = cst.FunctionDef if keyword == "def" else cst.ClassDef
        name = rest.strip()
        return lambda _, node: isinstance(node, definition) and node.name.value == name
    if keyword in ("if", "elif") and statement_form(pattern) is None:
        wanted = expression_form(rest)
        return lambda source, node: isinstance(node, cst.If) and source.form(node.test) == wanted
    wanted = statement_form(pattern)
    if wanted is None:
        raise ValueError(f"`{pattern}` is not Python")
    kind: type[cst.CSTNode] = type(
        cst.parse_module(textwrap.dedent(pattern).strip("\n") + "\n").body[0]
    )
    return lambda source, node: isinstance(node, kind) and source.form(node) == wanted


def statements(root: cst.CSTNode) -> Iterator[tuple[cst.BaseStatement, Block, int]]:
    """Every statement under `root` (elif branches included), with its block and index;
    under a module or a class, only its own statements (`module_of` edits module level,
    `class` the class's fields)."""
    found: list[tuple[cst.BaseStatement, Block, int]] = []
    if isinstance(root, cst.Module):
        return iter([(s, root, i) for i, s in enumerate(root.body)])
    if isinstance(root, cst.ClassDef) and isinstance(root.body, cst.IndentedBlock):
        block = root.body
        return iter([(s, block, i) for i, s in enumerate(block.body)])

    class Walker(cst.CSTVisitor):
        def on_visit(self, node: cst.CSTNode) -> bool:
            if isinstance(node, cst.Module | cst.IndentedBlock):
                for index, statement in enumerate(node.body):
                    if isinstance(statement, cst.BaseStatement):
                        found.append((statement, node, index))
            if isinstance(node, cst.If) and isinstance(node.orelse, cst.If):
                found.append((node.orelse, cst.IndentedBlock(body=()), -1))
            return True

    root.visit(Walker())
    return iter(found)


def expressions(root: cst.CSTNode, code: str, source: Source) -> list[cst.BaseExpression]:
    """The outermost expressions under `root` with the syntax tree of `code`."""
    found: list[cst.BaseExpression] = []
    wanted = expression_form(code)
    kind = type(cst.parse_expression(f"(\n{textwrap.dedent(code).strip()}\n)"))

    class Walker(cst.CSTVisitor):
        def on_visit(self, node: cst.CSTNode) -> bool:
            if isinstance(node, kind) and source.form(node) == wanted:
                found.append(node)
                return False
            return True

    root.visit(Walker())
    return found


def _strings(node: cst.CSTNode) -> set[str]:
    found: set[str] = set()
    for child in _walk(node):
        if isinstance(child, cst.SimpleString) and isinstance(child.evaluated_value, str):
            found.add(child.evaluated_value)
    return found


def _walk(node: cst.CSTNode) -> Iterator[cst.CSTNode]:
    yield node
    for child in node.children:
        yield from _walk(child)


def scopes(source: Source, edit: Edit) -> list[cst.CSTNode]:
    """The nodes in `source` that `edit`'s scope names."""
    if edit.scope == "module_of":
        defines = any(_defines(statement, edit.name) for statement in source.module.body)
        return [source.module] if defines else []
    return _named(source, edit)


def within(source: Source, scope: cst.CSTNode, edit: Edit) -> list[cst.CSTNode]:
    """`scope` narrowed to the bodies of its `if <edit.within>` (itself without `within`)."""
    if not edit.within:
        return [scope]
    match = statement_matcher(f"if {edit.within}")
    return [s.body for s, _, _ in statements(scope) if isinstance(s, cst.If) and match(source, s)]


def _defines(statement: cst.CSTNode, name: str) -> bool:
    if isinstance(statement, cst.FunctionDef | cst.ClassDef):
        return statement.name.value == name
    if isinstance(statement, cst.SimpleStatementLine):
        for small in statement.body:
            if isinstance(small, cst.Assign | cst.AnnAssign):
                targets = small.targets if isinstance(small, cst.Assign) else [small]
                for target in targets:
                    if isinstance(target.target, cst.Name) and target.target.value == name:
                        return True
    return False


def _named(source: Source, edit: Edit) -> list[cst.CSTNode]:
    """Functions by qualified name, or what is registered for a model (a decorator or
    an `if` test naming it); walks statements only, not expressions (fast)."""
    found: list[cst.CSTNode] = []

    def walk(body: Iterable[cst.CSTNode], path: tuple[str, ...], top: cst.CSTNode) -> None:
        for node in body:
            top = node if source.is_unit(node) else top
            inner = path
            if isinstance(node, cst.FunctionDef | cst.ClassDef):
                inner = (*path, node.name.value)
            hit: cst.CSTNode | None = None
            if isinstance(node, cst.FunctionDef | cst.ClassDef):
                qualified = ".".join(inner)
                wanted = cst.FunctionDef if edit.scope == "function" else cst.ClassDef
                named = f".{qualified}".endswith(f".{edit.name}")
                if edit.scope in ("function", "class") and isinstance(node, wanted) and named:
                    hit = node
            decorators = node.decorators if isinstance(node, cst.FunctionDef) else ()
            if edit.scope == "model" and any(edit.name in _strings(d) for d in decorators):
                hit = node
            if (
                isinstance(node, cst.If)
                and edit.scope == "model"
                and edit.name in _strings(node.test)
            ):
                hit = node.body
            if hit is not None:
                _focus_around(source, hit, top)
                found.append(hit)
            for attr in ("body", "orelse", "handlers", "finalbody"):
                child = getattr(node, attr, None)
                if isinstance(child, cst.IndentedBlock | cst.Else | cst.Finally):
                    child = child.body
                if isinstance(child, cst.IndentedBlock):
                    child = child.body
                if isinstance(child, cst.CSTNode):
                    child = [child]
                if isinstance(child, list | tuple):
                    walk(child, inner, top)

    walk(source.module.body, (), source.module)
    return found


def _focus_around(source: Source, hit: cst.CSTNode, top: cst.CSTNode) -> None:
    """Positions for what an edit in `hit` looks at. A class's own statements are
    units (ServerArgs: 6000 lines of fields and methods), so a class scope has its
    fields focused one by one and its methods only if an edit asks for them
    (`Source.span`); any other scope, the unit it is in."""
    if hit is top and isinstance(hit, cst.ClassDef) and isinstance(hit.body, cst.IndentedBlock):
        members = [m for m in hit.body.body if not isinstance(m, cst.FunctionDef)]
        if all(source.is_unit(member) for member in members):
            for member in members:
                source.focus(member)
            return
    source.focus(top)


def may_hold(edit: Edit, text: str) -> bool:
    """Whether a module's text can hold the edit's scope (a cheap filter before parsing:
    a model is registered by a string literal, a def by `def NAME`)."""
    if edit.scope in ("function", "class"):
        *classes, last = edit.name.split(".")
        keyword = "def" if edit.scope == "function" else "class"
        return all(key in text for key in [f"{keyword} {last}", *(f"class {c}" for c in classes)])
    if edit.scope == "model":
        return f'"{edit.name}"' in text or f"'{edit.name}'" in text
    return edit.name in text
