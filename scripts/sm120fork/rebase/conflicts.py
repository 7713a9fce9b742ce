"""What a stopped 3-way merge left in the work tree, for the report and --continue.

Git writes conflicts in diff3 style (the work repository sets it):

    <<<<<<< HEAD            ours: the new upstream, with the patches carried before
    ...
    ||||||| parent of ...   base: the old upstream the patch was made against
    ...
    =======
    ...                     theirs: the patch
    >>>>>>> ...

Each block becomes a `Conflict` whose line is the block's place in the
pristine new upstream file, the numbers a person finds in upstream's tree.
"""

from __future__ import annotations

import ast
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

from sm120fork.gates.semantics import TOKENS
from sm120fork.patches.diffs import git_hunks
from sm120fork.patches.lines import split_lines
from sm120fork.patches.patchfile import PatchFile
from sm120fork.rebase.state import Conflict
from sm120fork.rebase.workrepo import WorkRepo

_MARKERS = ("<<<<<<< ", "||||||| ", ">>>>>>> ")
_SEPARATOR = "======="


def describe(repo: WorkRepo, tip: str, upstream: str, patch: PatchFile) -> tuple[Conflict, ...]:
    """Every conflict of the stopped merge; `tip` is ours, `upstream` the pristine release."""
    found: list[Conflict] = []
    for path, stages in sorted(repo.unmerged().items()):
        worktree = repo.root / path
        text = worktree.read_text("utf-8", "replace") if worktree.is_file() else ""
        blocks = list(_blocks(split_lines(text)))
        if not blocks:
            found.append(_whole_file(path, stages, repo.read(tip, path) or "", patch))
            continue
        to_upstream = _to_upstream(repo, tip, upstream, path)
        for ours_line, ours, base, theirs in blocks:
            found.append(
                Conflict(
                    file=path,
                    line=to_upstream(ours_line),
                    gate=is_gate_text(ours, base, theirs),
                    ours=ours,
                    theirs=theirs,
                    base=base,
                )
            )
    return tuple(found)


@dataclass(frozen=True)
class Block:
    """One diff3 conflict block, each side as lines (with their line ends)."""

    ours: list[str]
    base: list[str]
    theirs: list[str]
    closed: bool  # False: the file ended before its >>>>>>> line


def segments(lines: list[str]) -> Iterator[str | Block]:
    """The file as it reads: plain lines, and a Block for each conflict block."""
    i = 0
    while i < len(lines):
        if not lines[i].startswith("<<<<<<< "):
            yield lines[i]
            i += 1
            continue
        sides: dict[str, list[str]] = {"ours": [], "base": [], "theirs": []}
        side = "ours"
        i += 1
        while i < len(lines) and not lines[i].startswith(">>>>>>> "):
            line = lines[i]
            if line.startswith("||||||| "):
                side = "base"
            elif line.rstrip("\n") == _SEPARATOR:
                side = "theirs"
            else:
                sides[side].append(line)
            i += 1
        yield Block(sides["ours"], sides["base"], sides["theirs"], closed=i < len(lines))
        i += 1


def _blocks(lines: list[str]) -> Iterable[tuple[int, str, str, str]]:
    """(line in ours where the block starts, ours, base, theirs) for each marker block."""
    ours_line = 0  # lines of the ours side seen so far
    for segment in segments(lines):
        if isinstance(segment, str):
            ours_line += 1
            continue
        yield ours_line + 1, "".join(segment.ours), "".join(segment.base), "".join(segment.theirs)
        ours_line += len(segment.ours)


def _to_upstream(repo: WorkRepo, tip: str, upstream: str, path: str) -> Callable[[int], int]:
    """Line numbers of ours (upstream with the patches before this one) -> lines of the
    pristine upstream file, through the hunks of `git diff -U0 upstream tip`."""
    if repo.read(upstream, path) is None:  # an earlier patch created it: ours is all there is
        return lambda line: line
    diff = repo.out("diff", "-U0", "--no-renames", "--no-color", upstream, tip, "--", path)
    hunks = [(h.old_start, h.old_count, h.new_start, h.new_count) for h in git_hunks(diff)]

    def mapped(line: int) -> int:
        shift = 0
        for old, old_count, new, new_count in hunks:
            new_last = new + new_count - 1 if new_count else new
            if line <= new_last:
                if new_count and line >= new:  # a line an earlier patch wrote
                    return old if old_count else old + 1
                break
            shift = (old + old_count - 1 if old_count else old) - new_last
        return line + shift

    return mapped


def _whole_file(path: str, stages: set[int], ours: str, patch: PatchFile) -> Conflict:
    """A conflict without markers: one side deleted or renamed the file."""
    hunks = next((f for f in patch.files if f.path == path), None)
    theirs = (
        "".join(f"{line.tag}{line.text}" for hunk in hunks.hunks for line in hunk.lines)
        if hunks
        else ("(the patch deletes this file)" if 3 not in stages else "")
    )
    if 2 not in stages:
        ours = ""  # upstream deleted (or moved) the file the patch changes
    return Conflict(file=path, line=0, gate=is_gate_text(ours, theirs), ours=ours, theirs=theirs)


def gate_conditions(text: str) -> list[str]:
    """The architecture conditions written in a conflict side: `if C:` -> `C`.

    Lines with a gate token that do not parse as an `if`/`elif`/`while`/
    `assert`/`return` on their own (a continued condition) are shown whole."""
    found: list[str] = []
    for line in split_lines(text):
        if is_gate_text(line):
            found.append(_condition(line.strip()))
    return found


def _condition(line: str) -> str:
    source = "if" + line[4:] if line.startswith("elif") else line
    for candidate in (source, source + " pass"):
        try:
            tree = ast.parse(candidate)
        except SyntaxError:
            continue
        statement = tree.body[0] if tree.body else None
        if isinstance(statement, ast.If | ast.While | ast.Assert):
            return ast.unparse(statement.test)
        if isinstance(statement, ast.Return) and statement.value is not None:
            return ast.unparse(statement.value)
        break
    return line


def is_gate_text(*texts: str) -> bool:
    """Does the text test the GPU architecture (the gate scanner's own pre-filter)?"""
    data = "".join(texts).encode("utf-8")
    return any(token in data for token in TOKENS)


def remaining_markers(repo: WorkRepo, paths: Iterable[str]) -> list[str]:
    """`path:line` of every conflict marker left in `paths` of the work tree."""
    left: list[str] = []
    for path in paths:
        file = repo.root / path
        if not file.is_file():
            continue
        text = file.read_text("utf-8", "replace")
        for lineno, line in enumerate(split_lines(text), start=1):
            if line.startswith(_MARKERS):  # a lone ======= may be an RST underline
                left.append(f"{path}:{lineno}")
    return left
