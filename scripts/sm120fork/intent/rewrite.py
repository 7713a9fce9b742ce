"""Find an intent's gate in one module and rewrite it, keeping formatting (libcst).

The gate is found by meaning, not by text: an `if` whose condition admits
`gate_admits`, inside a block whose header names the anchor (an `if` test,
a decorator), and whose body holds the first switch's old choice. Then:
the condition gains `or <sibling>` (the same helper form, for the included
arch), and each switched choice becomes `(new if <sibling> else old)`.
"""

from __future__ import annotations

import textwrap
from dataclasses import dataclass

import libcst as cst

from sm120fork.errors import FatalError
from sm120fork.intent.archexpr import admits, arch_terms, helper_name
from sm120fork.intent.model import Insert, Intent


class IntentError(FatalError):
    """An intent that does not fit the code it found (reported, never a traceback)."""


@dataclass(frozen=True)
class GateMatch:
    node: cst.If
    term: cst.BaseExpression  # the arch term that admits `gate_admits`
    already_included: bool  # upstream's condition admits the included arch already


def _strings(node: cst.CSTNode) -> set[str]:
    found: set[str] = set()

    class Collector(cst.CSTVisitor):
        def visit_SimpleString(self, string: cst.SimpleString) -> None:
            value = string.evaluated_value
            if isinstance(value, str):
                found.add(value)

    node.visit(Collector())
    return found


def find_gates(module: cst.Module, intent: Intent) -> list[GateMatch]:
    matches: list[GateMatch] = []
    first_old = intent.switches[0].old if intent.switches else None

    class Finder(cst.CSTVisitor):
        """Keeps the strings of the headers of the blocks whose bodies it is inside."""

        def __init__(self) -> None:
            super().__init__()
            self.headers: list[set[str]] = []

        def visit_If_body(self, node: cst.If) -> None:
            self.headers.append(_strings(node.test))

        def leave_If_body(self, node: cst.If) -> None:
            self.headers.pop()

        def visit_FunctionDef_body(self, node: cst.FunctionDef) -> None:
            self.headers.append(set().union(*(_strings(d) for d in node.decorators)))

        def leave_FunctionDef_body(self, node: cst.FunctionDef) -> None:
            self.headers.pop()

        def visit_If(self, node: cst.If) -> None:
            terms = [t for t in arch_terms(node.test) if admits(t, intent.gate_admits)]
            if not terms:
                return
            if first_old is not None and first_old not in _strings(node.body):
                return
            if not any(intent.anchor in header for header in self.headers):
                return
            included = admits(node.test, intent.include) is True or any(
                admits(t, intent.include) for t in arch_terms(node.test)
            )
            matches.append(GateMatch(node, terms[0], included))

    module.visit(Finder())
    return matches


def sibling_code(module: cst.Module, term: cst.BaseExpression, intent: Intent) -> str:
    """The included arch's form of `term`: `is_sm100_supported()` -> `is_sm120_supported()`."""
    bare = term.with_changes(lpar=[], rpar=[]) if term.lpar else term
    code = module.code_for_node(bare).strip()
    sibling = code.replace(intent.gate_admits, intent.include)
    if isinstance(term, cst.Name) and sibling.lstrip("_") not in _module_bindings(module):
        # A cached flag the module does not have for the included arch: call the helper.
        helper = helper_name(term) or ""
        sibling = helper.replace(intent.gate_admits, intent.include) + "()"
    return sibling


def _module_bindings(module: cst.Module) -> set[str]:
    names: set[str] = set()
    for statement in module.body:
        if isinstance(statement, cst.SimpleStatementLine):
            for small in statement.body:
                if isinstance(small, cst.ImportFrom) and not isinstance(
                    small.names, cst.ImportStar
                ):
                    names.update(_alias_name(a) for a in small.names)
                elif isinstance(small, cst.Assign):
                    for target in small.targets:
                        if isinstance(target.target, cst.Name):
                            names.add(target.target.value.lstrip("_"))
        elif isinstance(statement, cst.FunctionDef):
            names.add(statement.name.value)
    return names


def _alias_name(alias: cst.ImportAlias) -> str:
    if alias.asname is not None and isinstance(alias.asname.name, cst.Name):
        return alias.asname.name.value
    name = alias.name
    return name.value if isinstance(name, cst.Name) else name.attr.value


def rewrite_gate(module: cst.Module, match: GateMatch, intent: Intent) -> cst.Module:
    sibling = sibling_code(module, match.term, intent)
    test = match.node.test
    if isinstance(test, cst.BooleanOperation | cst.IfExp | cst.Lambda) and not test.lpar:
        test = test.with_changes(lpar=[cst.LeftParen()], rpar=[cst.RightParen()])
    new_test = cst.BooleanOperation(
        left=test,
        operator=cst.Or(),
        right=cst.parse_expression(sibling),
    )
    switches = {s.old: s.new for s in intent.switches}

    class Switcher(cst.CSTTransformer):
        def leave_SimpleString(
            self, original: cst.SimpleString, updated: cst.SimpleString
        ) -> cst.BaseExpression:
            value = original.evaluated_value
            if not isinstance(value, str) or value not in switches:
                return updated
            quote = original.quote
            new_literal = f"{quote}{switches[value]}{quote}"
            return cst.parse_expression(f"({new_literal} if {sibling} else {original.value})")

    new_body = match.node.body.visit(Switcher())
    assert isinstance(new_body, cst.BaseSuite)  # a transformer returning a suite for a suite
    for insert in intent.inserts:
        new_body = _insert_after(new_body, insert, sibling)
    new_if = match.node.with_changes(test=new_test, body=new_body)
    replaced = module.deep_replace(match.node, new_if)
    assert isinstance(replaced, cst.Module)
    return _ensure_import(replaced, match.term, sibling, intent)


def _insert_after(body: cst.BaseSuite, insert: Insert, sibling: str) -> cst.BaseSuite:
    """`insert.code` (with `{include}` filled in) after the body's assignment to `insert.after`."""
    if not isinstance(body, cst.IndentedBlock):
        raise IntentError(
            f"the gate's body is a one-line suite; cannot insert after {insert.after}"
        )
    code = textwrap.dedent(insert.code).strip("\n").replace("{include}", sibling) + "\n"
    statements = list(cst.parse_module(code).body)
    for index, statement in enumerate(body.body):
        if insert.after in _assigned_names(statement):
            new = [*body.body[: index + 1], *statements, *body.body[index + 1 :]]
            return body.with_changes(body=new)
    raise IntentError(f"the gate's body assigns no `{insert.after}` to insert after")


def _assigned_names(statement: cst.BaseStatement) -> set[str]:
    names: set[str] = set()
    if isinstance(statement, cst.SimpleStatementLine):
        for small in statement.body:
            targets = []
            if isinstance(small, cst.Assign):
                targets = [t.target for t in small.targets]
            elif isinstance(small, cst.AnnAssign | cst.AugAssign):
                targets = [small.target]
            names.update(t.value for t in targets if isinstance(t, cst.Name))
    return names


def _ensure_import(
    module: cst.Module, term: cst.BaseExpression, sibling: str, intent: Intent
) -> cst.Module:
    """Import the sibling helper beside the gate's own helper, if the module lacks it."""
    called = sibling.removesuffix("()")
    if not sibling.endswith("()") or "." in called or called in _module_bindings(module):
        return module
    original_helper = called.replace(intent.include, intent.gate_admits)

    class Importer(cst.CSTTransformer):
        done = False

        def leave_ImportFrom(
            self, original: cst.ImportFrom, updated: cst.ImportFrom
        ) -> cst.ImportFrom:
            if self.done or isinstance(updated.names, cst.ImportStar):
                return updated
            names = list(updated.names)
            for index, alias in enumerate(names):
                if _alias_name(alias) == original_helper:
                    # The new alias ends as the helper's alias ended; the helper now
                    # ends like an alias in the middle of the list.
                    middle = names[index - 1].comma if index > 0 else alias.comma
                    if not isinstance(middle, cst.Comma):
                        middle = cst.Comma(whitespace_after=cst.SimpleWhitespace(" "))
                    names[index] = alias.with_changes(comma=middle)
                    names.insert(
                        index + 1, cst.ImportAlias(name=cst.Name(called), comma=alias.comma)
                    )
                    self.done = True
                    return updated.with_changes(names=names)
            return updated

    return module.visit(Importer())
