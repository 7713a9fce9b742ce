"""Hunks of a git diff as text blocks, to keep only some of them.

When upstream changed under a patch (a rebase), the diff of a patched file
between BASE and HEAD also holds upstream's own changes elsewhere in the file;
the interdiff keeps the hunks that overlap what the patch changes.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from sm120fork.patches.diffs import parse_diff
from sm120fork.patches.lines import split_lines

Span = tuple[int, int]  # first line, one past the last (1-based)


@dataclass(frozen=True)
class Block:
    """One hunk of one file section: its text, and the lines it covers on each side."""

    path: str
    header: str  # the file section's header lines (diff --git, ---, +++)
    text: str
    old: Span
    new: Span


def _span(start: int, count: int) -> Span:
    return (start, start + max(count, 1))


def blocks(diff: str) -> list[Block]:
    """Each hunk of `diff` (git's output) with the text it has there, header included."""
    lines = split_lines(diff)
    found: list[Block] = []
    for file in parse_diff(diff):
        first = file.hunks[0].lineno - 1
        header = "".join(lines[file.lineno - 1 : first])
        for hunk in file.hunks:
            text = "".join(lines[hunk.lineno - 1 : hunk.lineno - 1 + hunk.diff_lines])
            old, new = _span(hunk.old_start, hunk.old_count), _span(hunk.new_start, hunk.new_count)
            found.append(Block(file.path, header, text, old, new))
    return found


def changed_spans(diff: str) -> dict[str, list[Span]]:
    """Per file, the lines the diff's hunks cover on its new side."""
    spans: dict[str, list[Span]] = {}
    for block in blocks(diff):
        spans.setdefault(block.path, []).append(block.new)
    return spans


def change_lines(diff: str) -> dict[str, list[str]]:
    """Per file, only the removed and added lines: the change without its place."""
    result: dict[str, list[str]] = {}
    for block in blocks(diff):
        lines = split_lines(block.text)[1:]
        result.setdefault(block.path, []).extend(ln for ln in lines if ln[:1] in ("-", "+"))
    return result


def _overlaps(span: Span, others: Iterable[Span]) -> bool:
    return any(span[0] < end and start < span[1] for start, end in others)


def keep_overlapping(
    diff: str, old_spans: dict[str, list[Span]], new_spans: dict[str, list[Span]]
) -> tuple[str, int]:
    """The hunks of `diff` whose old side overlaps `old_spans` or new side `new_spans`
    (per file), and how many hunks were left out."""
    kept: list[Block] = []
    dropped = 0
    for block in blocks(diff):
        if _overlaps(block.old, old_spans.get(block.path, ())) or _overlaps(
            block.new, new_spans.get(block.path, ())
        ):
            kept.append(block)
        else:
            dropped += 1
    out, current = [], None
    for block in kept:
        if block.header != current:
            out.append(block.header)
            current = block.header
        out.append(block.text)
    return "".join(out), dropped
