"""Functions upstream renamed, followed by an intent.

0.5.13 renamed `is_deepseek_nsa` to `is_deepseek_dsa` (NSA became DSA) and kept
its body: the NSA guard's intent, which finds its `if is_deepseek_nsa(hf_config)`,
no longer found it. A function the intent calls is renamed when the new release
defines it nowhere, and the one module that defined it in the previous release
now defines, in its place, one new function with the same body (its own name
aside). The intent is then read with the new name, and the rename is said.
"""

from __future__ import annotations

import ast
import builtins
import keyword
import re
from collections.abc import Callable, Iterable
from dataclasses import replace

from sm120fork.intent.model import NEW_FILE, Edit, Intent

_NOT_FUNCTIONS = set(dir(builtins)) | set(keyword.kwlist)

# function names -> the modules that define each (a name defined nowhere is left out)
Defining = Callable[[Iterable[str]], dict[str, list[str]]]
Reader = Callable[[str], "str | None"]  # a path -> its text
_CALLED = re.compile(r"(?<![.\w])([A-Za-z_]\w*)\s*\(")  # a plain call, not `x.f(`
_TEXTS = ("name", "target", "code", "within", "holding", "comment")


def follow(
    intent: Intent,
    old: tuple[Defining, Reader],
    new: tuple[Defining, Reader],
) -> tuple[Intent, dict[str, str]]:
    """`intent` with the functions it calls that upstream renamed between `old` and
    `new` (each a release's lookup) called by their new names, and those renames."""
    renames: dict[str, str] = {}
    called = _called(intent)
    gone = called - set(new[0](called))  # still defined somewhere: not renamed
    for name, homes in sorted(old[0](gone).items()) if gone else ():
        if len(homes) != 1:
            continue
        after = _renamed_to(name, old[1](homes[0]), new[1](homes[0]))
        if after is not None:
            renames[name] = after
    return applied(intent, renames), renames


def applied(intent: Intent, renames: dict[str, str]) -> Intent:
    """`intent` calling each renamed function by its new name."""
    if not renames:
        return intent

    def renamed(edit: Edit) -> Edit:
        def text(key: str) -> str:
            return renamed_text(getattr(edit, key), renames)

        if edit.scope == NEW_FILE:  # its path is no name to rename
            return replace(edit, code=text("code"))

        return replace(
            edit,
            name=text("name"),
            target=text("target"),
            code=text("code"),
            within=text("within"),
            holding=text("holding"),
            comment=text("comment"),
        )

    return replace(intent, edits=tuple(renamed(e) for e in intent.edits))


def renamed_text(text: str, renames: dict[str, str]) -> str:
    """`text` with each old name (a whole identifier) written as its new one; a chain of
    renames (a -> b, later b -> c) ends at the last name."""
    for old, new in renames.items():
        text = re.sub(rf"\b{re.escape(old)}\b", new, text)
    return text


def said(renames: dict[str, str]) -> str:
    pairs = ", ".join(f"{old}() -> {new}()" for old, new in sorted(renames.items()))
    return f"followed upstream's rename {pairs}"


def _called(intent: Intent) -> set[str]:
    """The functions the intent calls by name (builtins and keywords aside)."""
    return {
        match.group(1)
        for edit in intent.edits
        for key in _TEXTS
        for match in _CALLED.finditer(getattr(edit, key))
    } - _NOT_FUNCTIONS


def _renamed_to(name: str, before: str | None, after: str | None) -> str | None:
    """The one function `after` defines, `before` does not, with `name`'s body."""
    old_defs, new_defs = _functions(before), _functions(after)
    if name not in old_defs:
        return None
    body = old_defs[name]
    twins = [n for n, b in new_defs.items() if n not in old_defs and b == body]
    return twins[0] if len(twins) == 1 else None


def _functions(text: str | None) -> dict[str, str]:
    """Module-level function name -> its body's syntax tree (without the name)."""
    if text is None:
        return {}
    try:
        tree = ast.parse(text)
    except SyntaxError:
        return {}
    return {
        node.name: ast.dump(ast.Module(body=node.body, type_ignores=[])) + ast.dump(node.args)
        for node in tree.body
        if isinstance(node, ast.FunctionDef)
    }
