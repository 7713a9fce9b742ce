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

from dataclasses import replace

from sm120fork.patches.normalform import DiffRenderer
from sm120fork.patches.patchfile import PatchFile
from sm120fork.review.headers import header_changes
from sm120fork.review.hunks import change_lines, changed_spans, keep_overlapping
from sm120fork.review.model import PatchReview
from sm120fork.review.patched import Step


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
