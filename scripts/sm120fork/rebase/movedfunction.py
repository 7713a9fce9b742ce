"""A function that left its file, found by name elsewhere, and the patch merged into it.

When a hunk's own lines are not found anywhere (upstream edited the function
as it moved it: 0.5.19 moved `_olmo2_overrides` into its own module and
switched it to `get_platform()`), the function around the hunk still has a
name. If the new tree no longer defines it in the patch's file and defines it
in exactly one other file, where it is new since the previous release, the
function is merged 3-way there: base is the function at the previous release
without the patch, theirs with it, ours the function upstream moved, each
taken at its own indentation (a method may have become a function). A merge
that conflicts is resolved only by resolutions.py's rules; otherwise the move
is not the tool's to complete.
"""

from __future__ import annotations

import ast
import textwrap
from dataclasses import dataclass

from sm120fork.patches.applier import Overlay
from sm120fork.patches.diffs import Hunk
from sm120fork.patches.lines import split_lines
from sm120fork.rebase import resolutions
from sm120fork.rebase.strategy import CarryContext, text_of

_Def = ast.FunctionDef | ast.AsyncFunctionDef


@dataclass(frozen=True)
class Moved:
    path: str  # where the function now is
    name: str
    kinds: tuple[str, ...]  # the rules that resolved the merge's conflicts, if any


def enclosing(text: str, hunk: Hunk) -> str | None:
    """The innermost function of `text` (the patched file) holding the hunk's new lines."""
    first = hunk.new_start
    last = hunk.new_start + max(hunk.new_count, 1) - 1
    found = [node for node in _defs(text) if node.lineno <= first and last <= _end(node)]
    return max(found, key=lambda node: node.lineno).name if found else None


def merge(
    ctx: CarryContext, overlay: Overlay, home: str, name: str, candidates: list[str]
) -> Moved | None:
    """Merge the patch's change of function `name` of `home` into the one other file that
    now defines it; the file's new text is written to `overlay`."""
    if _segment(text_of(overlay, home), name) is not None:
        return None  # it is still at home: not a move
    base = _segment(ctx.repo.read(f"{ctx.previous}^", home) or "", name)
    theirs = _segment(ctx.repo.read(ctx.previous, home) or "", name)
    if base is None or theirs is None:
        return None
    places = []
    for path in candidates:
        text = text_of(overlay, path)
        if path == home or f"def {name}(" not in text:
            continue
        if _segment(ctx.repo.read(ctx.previous, path) or "", name) is None:
            places.append((path, text))
    if len(places) != 1:
        return None
    path, text = places[0]
    lines = split_lines(text)
    node = _only(text, name)
    if node is None:
        return None
    start, end = node.lineno - 1, _end(node)
    ours = "".join(lines[start:end])
    indent = ours[: len(ours) - len(ours.lstrip(" "))]
    merged = _merge3(ctx, textwrap.dedent(ours), textwrap.dedent(base), textwrap.dedent(theirs))
    if merged is None:
        return None
    body, kinds = merged
    indented = "".join(indent + line if line.strip() else line for line in split_lines(body))
    overlay.write(path, "".join(lines[:start]) + indented + "".join(lines[end:]))
    return Moved(path, name, kinds)


def _merge3(
    ctx: CarryContext, ours: str, base: str, theirs: str
) -> tuple[str, tuple[str, ...]] | None:
    scratch = ctx.repo.root / ".git" / "sm120fork-moved"
    scratch.mkdir(exist_ok=True)
    files = []
    for side, text in (("ours", ours), ("base", base), ("theirs", theirs)):
        (scratch / side).write_text(text, encoding="utf-8")
        files.append(str(scratch / side))
    result = ctx.repo.git("merge-file", "-p", "--diff3", *files, check=False)
    if result.returncode < 0 or result.returncode > 127:
        return None
    out = result.stdout.decode("utf-8")
    if result.returncode == 0:
        return out, ()
    resolved = resolutions.resolve_text(out)
    if resolved is None:
        return None
    order = [rule for rule, _ in resolutions.RULES]
    return resolved[0], tuple(sorted(resolved[1], key=order.index))


def _segment(text: str, name: str) -> str | None:
    node = _only(text, name)
    if node is None:
        return None
    return "".join(split_lines(text)[node.lineno - 1 : _end(node)])


def _only(text: str, name: str) -> _Def | None:
    found = [node for node in _defs(text) if node.name == name]
    return found[0] if len(found) == 1 else None


def _defs(text: str) -> list[_Def]:
    try:
        tree = ast.parse(text)
    except SyntaxError:
        return []
    return [node for node in ast.walk(tree) if isinstance(node, _Def)]


def _end(node: _Def) -> int:
    return node.end_lineno or node.lineno
