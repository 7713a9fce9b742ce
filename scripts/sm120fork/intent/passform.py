"""ServerArgs-method code rewritten for an override pass.

0.5.15 moved the model defaults out of ServerArgs methods, which set fields
(`self.attention_backend = "triton"`), into functions registered per model
architecture that read the arguments and return what they change
(`overrides["attention_backend"] = "triton"` ... `return overrides`). An intent
written in the method form keeps its meaning in the pass form when every field it
sets becomes an entry of the dict the function returns, and every field it reads
is read where the function reads its fields (`server_args.x`, 0.5.19's `cfg.x`).

That holds only while the code never reads a field it also sets: in the method
form the read sees the new value, in the pass form the write is only returned.
Such code, and code that uses `self` other than as fields (a method call), is left
for a person, and the reason says so.
"""

from __future__ import annotations

import ast
import io
import tokenize
from collections import Counter
from dataclasses import dataclass

from sm120fork.intent.freenames import first_line


@dataclass(frozen=True)
class PassForm:
    code: str | None  # the code in the pass form, or None when it has none
    note: str  # what was rewritten, or why it could not be


def rewrite(module: ast.Module, line: int, code: str) -> PassForm:
    """`code`, written for a ServerArgs method, in the form of the override pass around
    `line` of `module`."""
    function = _enclosing(module, line)
    if function is None or any(a.arg == "self" for a in function.args.args):
        return PassForm(None, "it is not inside a function that returns its overrides")
    returned = _returned_dict(function)
    if returned is None:
        return PassForm(None, "the function around it returns no dict of overrides")
    uses = _self_uses(code)
    if uses is None:
        return PassForm(None, "its code uses `self` other than to read or set a field")
    written = {field for field, _, _, write in uses if write}
    read = {field for field, _, _, write in uses if not write}
    if both := sorted(written & read):
        fields = ", ".join(f"self.{f}" for f in both)
        return PassForm(
            None,
            f"its code reads {fields} after setting it, which an override pass does not "
            "see (its writes are only returned): keeping the meaning is a person's choice",
        )
    reader = _reader(function, returned)
    if read and reader is None:
        return PassForm(None, "the override pass reads no fields that its code could read")
    lines = code.splitlines(keepends=True)
    for field, row, column, write in sorted(uses, key=lambda u: (u[1], u[2]), reverse=True):
        text = lines[row - 1]
        old = f"self.{field}"
        new = f'{returned}["{field}"]' if write else f"{reader}.{field}"
        lines[row - 1] = text[:column] + new + text[column + len(old) :]
    said = f"fields it sets are entries of `{returned}`, returned by `{function.name}`"
    if read:
        said += f", fields it reads are read from `{reader}`"
    return PassForm("".join(lines), f"written in the override-pass form ({said})")


def _enclosing(module: ast.Module, line: int) -> ast.FunctionDef | None:
    around = [
        node
        for node in ast.walk(module)
        if isinstance(node, ast.FunctionDef) and first_line(node) <= line <= (node.end_lineno or 0)
    ]
    return max(around, key=lambda node: node.lineno, default=None)  # the innermost


def _returned_dict(function: ast.FunctionDef) -> str | None:
    """The local the function builds as a dict and returns (`overrides`)."""
    built: set[str] = set()
    returned: set[str] = set()
    for node in ast.walk(function):
        value = getattr(node, "value", None)
        if isinstance(node, ast.Assign | ast.AnnAssign) and _is_new_dict(value):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            built |= {t.id for t in targets if isinstance(t, ast.Name)}
        if isinstance(node, ast.Return) and isinstance(node.value, ast.Name):
            returned.add(node.value.id)
    names = sorted(built & returned)
    return names[0] if len(names) == 1 else None


def _is_new_dict(value: ast.AST | None) -> bool:
    if isinstance(value, ast.Dict):
        return True
    return (
        isinstance(value, ast.Call) and isinstance(value.func, ast.Name) and value.func.id == "dict"
    )


def _reader(function: ast.FunctionDef, returned: str) -> str | None:
    """The name the function reads its fields from: its first parameter, or a local
    made from it (0.5.19's `cfg = resolving_view(server_args)`), whichever it reads
    most."""
    if not function.args.args:
        return None
    first = function.args.args[0].arg
    sources = {first}
    for node in ast.walk(function):
        if (
            isinstance(node, ast.Assign)
            and isinstance(node.value, ast.Call)
            and any(isinstance(a, ast.Name) and a.id == first for a in node.value.args)
        ):
            sources |= {t.id for t in node.targets if isinstance(t, ast.Name)}
    reads = Counter(
        node.value.id
        for node in ast.walk(function)
        if isinstance(node, ast.Attribute)
        and isinstance(node.value, ast.Name)
        and node.value.id in sources - {returned}
        and isinstance(node.ctx, ast.Load)
    )
    return reads.most_common(1)[0][0] if reads else None


_AUGMENTED = frozenset(
    {"+=", "-=", "*=", "/=", "//=", "%=", "**=", "|=", "&=", "^=", ">>=", "<<=", "@="}
)
_Use = tuple[str, int, int, bool]  # field, row, column of `self`, whether it is set


def _self_uses(code: str) -> list[_Use] | None:
    """Each `self.<field>` in `code` and whether the statement sets it (`self.x = v`
    at the start of a line); None if `self` appears any other way."""
    try:
        tokens = [
            t
            for t in tokenize.generate_tokens(io.StringIO(code).readline)
            if t.type not in (tokenize.COMMENT, tokenize.NL)
        ]
    except (tokenize.TokenError, IndentationError):
        return None
    uses: list[_Use] = []
    for index, token in enumerate(tokens):
        if token.type != tokenize.NAME or token.string != "self":
            continue
        dot, name, after = (
            tokens[index + k] if index + k < len(tokens) else None for k in (1, 2, 3)
        )
        if dot is None or dot.string != "." or name is None or name.type != tokenize.NAME:
            return None
        if after is not None and after.string in ("(", "["):
            return None  # a method call or an item of a field: not a plain field
        starts = index == 0 or tokens[index - 1].type in (
            tokenize.NEWLINE,
            tokenize.INDENT,
            tokenize.DEDENT,
        )
        if after is not None and after.string in _AUGMENTED:
            return None  # `self.x += 1` reads and sets it
        if (
            after is not None
            and after.string in ("=", ":")
            and not (starts and after.string == "=")
        ):
            return None  # `a = self.x = v`, `self.x: int = v`: not one plain field set
        write = starts and after is not None and after.string == "="
        uses.append((name.string, token.start[0], token.start[1], write))
    return uses
