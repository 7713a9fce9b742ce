"""What a change to one patch does: its header changes and its interdiff.

The interdiff is the diff of the patched file (the file after this patch,
with the patches before it applied) from BASE to HEAD, not a diff of the
.patch text. When the file below the patch is the same on both sides, that
diff is exactly the change in what the patch does; when upstream (or an
earlier patch) changed it too, only the hunks overlapping the patch's own
lines are kept. A patch whose removed and added lines are the same on both
sides is a refresh, said in one line.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, replace

from sm120fork.patches.dep3 import Dep3Header
from sm120fork.patches.diffs import parse_diff
from sm120fork.patches.lines import split_lines
from sm120fork.patches.normalform import DiffRenderer
from sm120fork.patches.patchfile import PatchFile
from sm120fork.review.model import FieldChange, PatchReview
from sm120fork.review.patched import Step

# ---- DEP-3 header changes: subject, description, evidence, dates.


def _bugs(header: Dep3Header) -> str:
    return ", ".join(
        f.value.strip()
        for f in header.fields
        if f.name.lower() == "bug" or f.name.lower().startswith("bug-")
    )


def _field(header: Dep3Header, *names: str) -> str:
    found = header.get(*names)
    return found.value.strip() if found else ""


def fields(header: Dep3Header) -> dict[str, str]:
    """The fields a reviewer compares, each as one string ("" when absent)."""
    return {
        "Subject": header.subject,
        "Description": header.description,
        "Author": _field(header, "From", "Author"),
        "Origin": _field(header, "Origin"),
        "Bug": _bugs(header),
        "Forwarded": _field(header, "Forwarded"),
        "Last-Update": _field(header, "Last-Update"),
    }


def header_changes(old: Dep3Header, new: Dep3Header) -> tuple[FieldChange, ...]:
    before, after = fields(old), fields(new)
    return tuple(
        FieldChange(name, before[name] or None, after[name] or None)
        for name in before
        if before[name] != after[name]
    )


# ---- Hunks of a git diff as text blocks, to keep those overlapping the patch's lines.

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


# ---- The review of one patch.


def diff_part(patch: PatchFile) -> bytes:
    """The patch without its header: what it does, at which lines."""
    lines = patch.raw.split(b"\n")
    return b"\n".join(lines[patch.header_lines :])


def added(patch: PatchFile, step: Step, renderer: DiffRenderer) -> PatchReview:
    review = PatchReview(patch.name, "added", "added", patch.header.subject, patch.paths)
    if step.error:
        return _unapplied(review, "HEAD", step.error)
    return _with(review, interdiff=renderer.diff(step.before, step.after))


def removed(patch: PatchFile, step: Step, renderer: DiffRenderer) -> PatchReview:
    review = PatchReview(patch.name, "removed", "removed", patch.header.subject, patch.paths)
    if step.error:
        return _unapplied(review, "BASE", step.error)
    return _with(review, interdiff=renderer.diff(step.after, step.before))


def changed(
    old: PatchFile, new: PatchFile, base: Step, head: Step, renderer: DiffRenderer
) -> PatchReview | None:
    """The review of a patch on both sides; None when nothing about it changed."""
    renamed = old.name != new.name
    if old.raw == new.raw and not renamed and not (head.error and not base.error):
        return None
    review = PatchReview(
        name=new.name,
        status="renamed" if renamed else "changed",
        effect="header-only",
        subject=new.header.subject,
        files=tuple(dict.fromkeys((*old.paths, *new.paths))),
        old_name=old.name if renamed else None,
        header=header_changes(old.header, new.header),
    )
    for side, step in (("BASE", base), ("HEAD", head)):
        if step.error:
            return _unapplied(review, side, step.error)
    if diff_part(old) == diff_part(new):
        return review if review.header else _with(review, effect="same")
    if base.before == head.before:
        interdiff = renderer.diff(base.after, head.after)
        effect = "changed" if interdiff else "refresh"
        return _with(review, effect=effect, interdiff=interdiff)
    # The file below the patch changed as well (a rebase, or an earlier patch).
    old_diff = renderer.diff(base.before, base.after)
    new_diff = renderer.diff(head.before, head.after)
    if change_lines(old_diff) == change_lines(new_diff):
        note = "the file below it changed; it removes and adds the same lines"
        return _with(review, effect="refresh", note=note)
    interdiff, dropped = keep_overlapping(
        renderer.diff(base.after, head.after), changed_spans(old_diff), changed_spans(new_diff)
    )
    note = (
        f"{dropped} hunk{'s' if dropped != 1 else ''} of changes below the patch "
        "(upstream's, or an earlier patch's) left out"
        if dropped
        else ""
    )
    return _with(review, effect="changed", interdiff=interdiff, note=note)


def _unapplied(review: PatchReview, side: str, error: str) -> PatchReview:
    return _with(review, effect="unapplied", note=f"does not apply at {side}: {error}")


def _with(
    review: PatchReview, *, effect: str = "", interdiff: str = "", note: str = ""
) -> PatchReview:
    """`review` with the given fields set (an empty argument keeps the field)."""
    return replace(
        review,
        effect=effect or review.effect,
        interdiff=interdiff or review.interdiff,
        note=note or review.note,
    )
