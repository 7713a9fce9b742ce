"""Parse unified diffs (git's flavour) into immutable records.

Only what a source patch series needs: text hunks, new and deleted files.
Renames, mode changes and binary patches are refused, because a reviewer
cannot read them and quilt cannot refresh them.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from sm120fork.errors import FatalError
from sm120fork.lines import split_lines

_HUNK = re.compile(r"@@ -(\d+)(?:,(\d+))? \+(\d+)(?:,(\d+))? @@(.*)")
_NO_NEWLINE = "\\ No newline at end of file"
_GIT_HEADER = re.compile(r"diff --git (\S+) (\S+)$")
_IGNORED_EXTENDED = ("index ", "similarity index", "dissimilarity index")
_REFUSED_EXTENDED = ("old mode", "new mode", "rename from", "rename to", "copy from", "copy to")


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
    lineno: int

    @property
    def old_lines(self) -> list[str]:
        return [line.text for line in self.lines if line.tag != "+"]

    @property
    def new_lines(self) -> list[str]:
        return [line.text for line in self.lines if line.tag != "-"]


@dataclass(frozen=True)
class FileDiff:
    old_path: str | None  # None for a new file (/dev/null)
    new_path: str | None  # None for a deleted file
    hunks: tuple[Hunk, ...]
    lineno: int

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
    """Parse every file section of `text`; line numbers are offset by `first_lineno`."""
    lines = split_lines(text)
    files: list[FileDiff] = []
    i = 0
    while i < len(lines):
        line = lines[i].rstrip("\r\n")
        lineno = first_lineno + i
        if line.startswith(("GIT binary patch", "Binary files ")):
            raise DiffError(lineno, "binary patches are not supported; vendor binaries unchanged")
        if line.startswith(_REFUSED_EXTENDED):
            raise DiffError(lineno, f"unsupported diff header {line!r}: renames and mode changes")
        if line.startswith("--- ") and i + 1 < len(lines) and lines[i + 1].startswith("+++ "):
            old = strip_path(line[4:], strip, lineno)
            new = strip_path(lines[i + 1].rstrip("\r\n")[4:], strip, lineno + 1)
            if old is None and new is None:
                raise DiffError(lineno, "both sides of the file header are /dev/null")
            if old is not None and new is not None and old != new:
                raise DiffError(lineno, f"renaming {old!r} to {new!r} is not supported")
            i, hunks = _parse_hunks(lines, i + 2, first_lineno)
            if not hunks:
                raise DiffError(lineno, f"file section for {new or old!r} has no hunks")
            files.append(FileDiff(old, new, tuple(hunks), lineno))
            continue
        if line.startswith("@@"):
            raise DiffError(lineno, "hunk without a '--- a/...' '+++ b/...' file header")
        i += 1
    return tuple(files)


def _parse_hunks(lines: list[str], i: int, first_lineno: int) -> tuple[int, list[Hunk]]:
    hunks: list[Hunk] = []
    while i < len(lines):
        match = _HUNK.match(lines[i].rstrip("\r\n"))
        if match is None:
            break
        lineno = first_lineno + i
        old_start, new_start = int(match.group(1)), int(match.group(3))
        old_count = int(match.group(2)) if match.group(2) is not None else 1
        new_count = int(match.group(4)) if match.group(4) is not None else 1
        i += 1
        body: list[HunkLine] = []
        old_seen = new_seen = 0
        while i < len(lines) and (old_seen < old_count or new_seen < new_count):
            raw = lines[i]
            tag = raw[:1]
            if tag not in (" ", "-", "+"):
                if raw.rstrip("\r\n") == "":  # some tools drop the space of empty context
                    tag, raw = " ", " " + raw
                else:
                    break
            body.append(HunkLine(tag, raw[1:]))
            old_seen += tag != "+"
            new_seen += tag != "-"
            i += 1
            if i < len(lines) and lines[i].rstrip("\r\n") == _NO_NEWLINE:
                last = body[-1]
                body[-1] = HunkLine(last.tag, last.text.rstrip("\n").rstrip("\r"))
                i += 1
        if (old_seen, new_seen) != (old_count, new_count):
            raise DiffError(
                lineno,
                f"hunk says -{old_count} +{new_count} lines but has -{old_seen} +{new_seen}; "
                "the patch is truncated or was edited by hand without fixing the counts",
            )
        hunks.append(
            Hunk(old_start, old_count, new_start, new_count, match.group(5), tuple(body), lineno)
        )
    return i, hunks


def diff_start(lines: list[str]) -> int | None:
    """Index of the first line of the diff part of a patch file, if any."""
    for i, line in enumerate(lines):
        if _GIT_HEADER.match(line.rstrip("\r\n")) or line.startswith("Index: "):
            return i
        if line.startswith("--- ") and i + 1 < len(lines) and lines[i + 1].startswith("+++ "):
            return i
    return None


def is_ignored_extended_header(line: str) -> bool:
    return line.startswith(_IGNORED_EXTENDED)
