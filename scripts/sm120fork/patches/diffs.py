"""Unified diffs (git's flavour) as immutable records, parsed by python-unidiff.

`PatchSet` does the parsing; this module holds the fork's policy as
checks on the parsed set, each failing with one line that names the diff line:
only text hunks, new and deleted files. Renames, copies, mode changes and
binary patches are refused, because a reviewer cannot read them and quilt
cannot refresh them; a file section's `---`/`+++` paths must stay in the tree.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass

from unidiff.constants import (
    LINE_TYPE_ADDED,
    LINE_TYPE_CONTEXT,
    LINE_TYPE_NO_NEWLINE,
    LINE_TYPE_REMOVED,
)
from unidiff.errors import UnidiffParseError
from unidiff.patch import Hunk as ParsedHunk
from unidiff.patch import PatchedFile, PatchSet

from sm120fork.errors import FatalError
from sm120fork.patches.lines import split_lines

_GIT_HEADER = re.compile(r"diff --git (\S+) (\S+)$")
_REFUSED_EXTENDED = ("old mode", "new mode", "rename from", "rename to", "copy from", "copy to")
_TAGS = {LINE_TYPE_CONTEXT, LINE_TYPE_REMOVED, LINE_TYPE_ADDED}
_COUNTS_HINT = "the patch is truncated or was edited by hand without fixing the counts"


class DiffError(FatalError):
    """A diff that cannot be parsed; `lineno` is 1-based within the diff text."""

    def __init__(self, lineno: int, message: str) -> None:
        super().__init__(message)
        self.lineno = lineno


@dataclass(frozen=True)
class HunkLine:
    tag: str  # " ", "-" or "+"
    text: str  # with its "\n", unless the file ends without one


@dataclass(frozen=True)
class Hunk:
    old_start: int
    old_count: int
    new_start: int
    new_count: int
    section: str
    lines: tuple[HunkLine, ...]
    lineno: int  # of its @@ line

    @property
    def old_lines(self) -> list[str]:
        return [line.text for line in self.lines if line.tag != "+"]

    @property
    def new_lines(self) -> list[str]:
        return [line.text for line in self.lines if line.tag != "-"]

    @property
    def diff_lines(self) -> int:
        """Lines it takes in its diff: the @@ line, the body, each "\\ No newline" marker."""
        return 1 + len(self.lines) + sum(not line.text.endswith("\n") for line in self.lines)


@dataclass(frozen=True)
class FileDiff:
    old_path: str | None  # None for a new file (/dev/null)
    new_path: str | None  # None for a deleted file
    hunks: tuple[Hunk, ...]
    lineno: int  # where its section starts (`diff --git`, else `---`)

    @property
    def path(self) -> str:
        """The file this diff changes (its path after stripping)."""
        return self.new_path or self.old_path or ""


def strip_path(raw: str, strip: int, lineno: int) -> str | None:
    """Strip `strip` leading components; refuse paths that leave the tree."""
    raw = raw.split("\t", 1)[0].strip()
    if raw == "/dev/null":
        return None
    if raw.startswith("/"):
        raise DiffError(lineno, f"path {raw!r} is absolute; patches must use relative a/ b/ paths")
    parts = raw.split("/")
    if len(parts) <= strip:
        raise DiffError(lineno, f"path {raw!r} has fewer than {strip + 1} components for -p{strip}")
    kept = parts[strip:]
    if any(part in ("", ".", "..") for part in kept) or "\\" in raw:
        raise DiffError(lineno, f"path {raw!r} leaves the tree or is not normalised")
    return "/".join(kept)


def parse_diff(text: str, strip: int = 1, first_lineno: int = 1) -> tuple[FileDiff, ...]:
    """Every file section of `text`, checked against the policy; line numbers in records
    and errors are offset by `first_lineno`."""
    lines = split_lines(text)
    patch_set = _patch_set(lines, first_lineno)
    files: list[FileDiff] = []
    for patched in patch_set:
        _refuse_unsupported(patched, first_lineno)
        files.append(_file_diff(patched, lines, strip, first_lineno))
    return tuple(files)


def git_hunks(text: str) -> tuple[Hunk, ...]:
    """The hunks of git's own diff output (`git diff -U0 A B -- path`), in order."""
    return tuple(hunk for file in parse_diff(text) for hunk in file.hunks)


def diff_start(lines: list[str]) -> int | None:
    """Index of the first line of the diff part of a patch file, if any."""
    for i, line in enumerate(lines):
        if _GIT_HEADER.match(line.rstrip("\r\n")) or line.startswith("Index: "):
            return i
        if line.startswith("--- ") and i + 1 < len(lines) and lines[i + 1].startswith("+++ "):
            return i
    return None


class _Cursor:
    """Feeds lines to unidiff and remembers where it was when it gave up."""

    def __init__(self, lines: list[str]) -> None:
        self.lines = lines
        self.lineno = 0
        self.hunk_lineno = 0
        self.hunk_header = ""

    def __iter__(self) -> Iterator[str]:
        for line in self.lines:
            self.lineno += 1
            if line.startswith("@@"):
                self.hunk_lineno, self.hunk_header = self.lineno, line.rstrip("\n")
            yield line


def _patch_set(lines: list[str], first_lineno: int) -> PatchSet:
    cursor = _Cursor(lines)
    try:
        return PatchSet(cursor)
    except UnidiffParseError as error:
        reason = str(error)
        if reason.startswith("Unexpected hunk found"):
            where, message = cursor.lineno, "hunk without a '--- a/...' '+++ b/...' file header"
        elif reason.startswith(("Hunk is", "Hunk diff line expected")):
            where = cursor.hunk_lineno
            message = f"hunk {cursor.hunk_header!r} does not hold the lines it counts"
            message += f"; {_COUNTS_HINT}"
        elif reason.startswith("Target without source"):
            strip_path(lines[cursor.lineno - 1][4:], 0, first_lineno + cursor.lineno - 1)
            where, message = cursor.lineno, "'+++' line without a '---' line for the same file"
        else:
            where, message = cursor.lineno, f"cannot parse the diff: {reason}"
        raise DiffError(first_lineno + max(where, 1) - 1, message) from error


def _section_lineno(patched: PatchedFile) -> int:
    """Where the section starts: its `diff --git` line, else its `---` line."""
    line = int(patched.diff_line_no or 1)
    info = patched.patch_info or ()
    if patched.is_binary_file or (info and info[0].startswith("diff --git ")):
        return line
    return max(line - 1, 1)  # unidiff counts a plain section from its `+++` line


def _refuse_unsupported(patched: PatchedFile, first_lineno: int) -> None:
    lineno = first_lineno + _section_lineno(patched) - 1
    if patched.is_binary_file:
        raise DiffError(lineno, "binary patches are not supported; vendor binaries unchanged")
    for index, line in enumerate(patched.patch_info or ()):
        if line.startswith(_REFUSED_EXTENDED):
            where = lineno + index  # a git header: its lines follow `diff --git` in order
            shown = line.rstrip("\n")
            raise DiffError(where, f"unsupported diff header {shown!r}: renames and mode changes")
    if not patched:
        raise DiffError(lineno, f"file section for {patched.path!r} has no hunks")


def _file_diff(patched: PatchedFile, lines: list[str], strip: int, first_lineno: int) -> FileDiff:
    hunks = tuple(_hunk(h, first_lineno) for h in patched)
    at = hunks[0].lineno - first_lineno  # index of the first @@ line in `lines`
    if at < 2 or not (lines[at - 2].startswith("--- ") and lines[at - 1].startswith("+++ ")):
        raise DiffError(hunks[0].lineno, "hunk without a '--- a/...' '+++ b/...' file header")
    old_lineno = first_lineno + at - 2
    old = strip_path(lines[at - 2].rstrip("\n")[4:], strip, old_lineno)
    new = strip_path(lines[at - 1].rstrip("\n")[4:], strip, old_lineno + 1)
    if old is None and new is None:
        raise DiffError(old_lineno, "both sides of the file header are /dev/null")
    if old is not None and new is not None and old != new:
        raise DiffError(old_lineno, f"renaming {old!r} to {new!r} is not supported")
    return FileDiff(old, new, hunks, first_lineno + _section_lineno(patched) - 1)


def _hunk(hunk: ParsedHunk, first_lineno: int) -> Hunk:
    body: list[HunkLine] = []
    for line in hunk:
        if line.line_type in _TAGS:
            body.append(HunkLine(line.line_type, line.value))
        elif line.line_type == LINE_TYPE_NO_NEWLINE and body:
            last = body[-1]
            body[-1] = HunkLine(last.tag, last.text.removesuffix("\n"))
    numbered = [line.diff_line_no for line in hunk if line.diff_line_no]
    lineno = first_lineno + (numbered[0] - 2 if numbered else 0)
    if not body:
        raise DiffError(lineno, f"hunk has no lines; {_COUNTS_HINT}")
    return Hunk(
        old_start=hunk.source_start,
        old_count=hunk.source_length,
        new_start=hunk.target_start,
        new_count=hunk.target_length,
        section=_section(hunk.section_header),
        lines=tuple(body),
        lineno=lineno,
    )


def _section(header: str) -> str:
    """The text after the closing @@ as git writes it (unidiff drops the space)."""
    return f" {header}" if header else ""
