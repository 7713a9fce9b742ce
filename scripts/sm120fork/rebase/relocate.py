"""A patch whose code left its file: re-applied where upstream moved it.

0.5.15 moved MLA, DeepSeek and Olmo2 logic out of `server_args.py` into
`arg_groups/overrides.py`; 0.5.19 moved Olmo2's override on into
`arg_groups/model_overrides/olmo2.py`. A hunk that no longer applies to its
own file (at any offset, or the file is gone) is looked for across the new
tree: its old lines (context and removed), indented alike or uniformly
shifted (a method that became a function), found in exactly one place of
another Python file, where they are new since the previous release (moved
there, not a copy that was always there). Several such places: the one
inside a function of the hunk's own section name, if exactly one is. Every
hunk must apply at home or be found so, or else lie in a function that
moved whole (movedfunction.py); otherwise this is not a move the tool can be
sure of, and the strategies after it decide.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace
from pathlib import PurePosixPath

from sm120fork.patches.applier import ApplyError, Overlay, apply_file, write_changes
from sm120fork.patches.diffs import FileDiff, Hunk, HunkLine
from sm120fork.rebase.movedfunction import enclosing, merge
from sm120fork.rebase.strategy import CarriedPatch, CarryContext, Outcome, finish, text_of

_DEF = re.compile(r"^\s*(?:async\s+)?def\s+(\w+)")
_MIN_LINES = 2  # non-blank old lines a hunk needs to be looked for elsewhere


@dataclass(frozen=True)
class Place:
    path: str
    start: int  # 0-based line of the new file where the hunk's old lines begin
    shift: int  # indentation added (negative: removed)


def try_relocate(ctx: CarryContext, patch: CarriedPatch) -> Outcome | None:
    overlay = Overlay(ctx.repo.root)
    said: list[str] = []  # where each moved hunk or function went
    kinds: list[str] = []  # the rules a moved function's merge needed
    candidates = [p for p in ctx.repo.files() if p.endswith(".py")]
    for diff in patch.parsed.files:
        if diff.old_path is None or diff.new_path is None:
            if not _apply(overlay, diff, diff.path):
                return None  # a created or deleted file does not move
            continue
        patched = ctx.repo.read(ctx.previous, diff.path) or ""
        placed: set[str | None] = set()  # the functions of hunks placed one by one
        functions: list[str] = []  # the functions to merge whole where they went
        for hunk in diff.hunks:
            home = enclosing(patched, hunk)
            one = replace(diff, hunks=(hunk,))
            if _apply(overlay, one, diff.path):
                placed.add(home)
                continue
            place = _find(ctx, overlay, hunk, diff.path, candidates)
            there = _moved(one, hunk, place) if place is not None else None
            if place is not None and there is not None and _apply(overlay, there, place.path):
                placed.add(home)
                said.append(f"{_name(diff.path)} -> {_name(place.path)}:{place.start + 1}")
                said[-1] += f" (re-indented {place.shift:+d})" if place.shift else ""
            elif home is None:
                return None
            elif home not in functions:
                functions.append(home)
        if placed & set(functions):
            return None  # part of a function placed hunk by hunk: not one move
        for name in functions:
            found = merge(ctx, overlay, diff.path, name, candidates)
            if found is None:
                return None
            said.append(f"{_name(diff.path)}:{name}() -> {_name(found.path)}, merged 3-way")
            kinds += [kind for kind in found.kinds if kind not in kinds]
    if not said:
        return None
    write_changes(ctx.repo.root, overlay.changes)
    reason = (
        f"its code left its file in {ctx.version}: re-applied where it went "
        f"({'; '.join(said)}); refreshed"
    )
    return finish(ctx, patch.parsed, "merged", reason, "+".join(["relocate", *kinds]))


def _name(path: str) -> str:
    return PurePosixPath(path).name


def _apply(overlay: Overlay, diff: FileDiff, path: str) -> bool:
    try:
        text, _ = apply_file(overlay.read(path), diff, allow_offset=True)
    except ApplyError:
        return False
    overlay.write(path, text)
    return True


def _find(
    ctx: CarryContext, overlay: Overlay, hunk: Hunk, home: str, candidates: list[str]
) -> Place | None:
    old = hunk.old_lines
    if sum(bool(line.strip()) for line in old) < _MIN_LINES:
        return None
    probe = max((line.strip() for line in old), key=len)
    if probe in text_of(overlay, home):
        return None  # its most telling line is still at home: edited there, not moved
    places: list[Place] = []
    for path in candidates:
        if path == home:
            continue
        text = text_of(overlay, path)
        if probe not in text:
            continue
        before = ctx.repo.read(ctx.previous, path) or ""
        if _matches(old, before.splitlines(keepends=True)):
            continue  # the lines were there already: a copy, not a move
        lines = text.splitlines(keepends=True)
        places += [Place(path, start, shift) for start, shift in _matches(old, lines)]
    if len(places) > 1:
        name = _DEF.match(hunk.section)
        places = [p for p in places if name and _enclosing(overlay, p) == name.group(1)]
    return places[0] if len(places) == 1 else None


def _matches(old: list[str], lines: list[str]) -> list[tuple[int, int]]:
    """(start, indentation shift) of every place where `old` matches `lines`."""
    found = []
    for start in range(len(lines) - len(old) + 1):
        shift = _shift(old, lines[start : start + len(old)])
        if shift is not None:
            found.append((start, shift))
    return found


def _shift(old: list[str], new: list[str]) -> int | None:
    shift: int | None = None
    for a, b in zip(old, new, strict=True):
        if not a.strip():
            if b.strip():
                return None
            continue
        if a.lstrip(" ") != b.lstrip(" "):
            return None
        delta = _indent(b) - _indent(a)
        if shift is not None and delta != shift:
            return None
        shift = delta
    return shift


def _indent(line: str) -> int:
    return len(line) - len(line.lstrip(" "))


def _moved(diff: FileDiff, hunk: Hunk, place: Place) -> FileDiff | None:
    """The one-hunk diff for its new file: at its new line, re-indented (None: an added
    line has less indentation than the shift takes away)."""
    texts = [_reindent(line.text, place.shift) for line in hunk.lines]
    if any(text is None for text in texts):
        return None
    lines = tuple(
        HunkLine(line.tag, t) for line, t in zip(hunk.lines, texts, strict=True) if t is not None
    )
    start = place.start + 1
    moved = replace(hunk, old_start=start, new_start=start, lines=lines)
    return replace(diff, old_path=place.path, new_path=place.path, hunks=(moved,))


def _reindent(text: str, shift: int) -> str | None:
    if not text.strip() or shift == 0:
        return text
    if shift > 0:
        return " " * shift + text
    return text[-shift:] if text[:-shift].strip(" ") == "" else None


def _enclosing(overlay: Overlay, place: Place) -> str | None:
    lines = text_of(overlay, place.path).splitlines()
    indent = _indent(lines[place.start]) if place.start < len(lines) else 0
    for line in reversed(lines[: place.start]):
        found = _DEF.match(line)
        if found and _indent(line) < indent:
            return found.group(1)
    return None
