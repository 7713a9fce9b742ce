"""review.md: the review as a pull-request comment, verdict first.

Rendered from the `Review` record. Interdiffs and gate lists are shortened
step by step until the comment fits GitHub's limit; review.json has them all.
"""

from __future__ import annotations

from sm120fork.markdown import cell, code
from sm120fork.review.mdgates import behaviour_section, checks_section, gates_section
from sm120fork.review.mdtext import BODY_LIMIT, bullets, details, fenced, plural
from sm120fork.review.model import EFFECTS, PatchReview, Review, RevInfo, SeriesReview

MARKER = "<!-- sm120fork-review -->"  # the workflow finds its own comment by this line
_LIMITS = (None, 1000, 400, 200, 100, 50, 25, 12, 6, 3, 0)  # lines or items per list


def render(review: Review) -> str:
    for limit in _LIMITS:
        text = _render(review, limit)
        if len(text) <= BODY_LIMIT:
            return text
    return text


def _side(info: RevInfo) -> str:
    version = f", sglang {info.version}" if info.version else ""
    return f"{code(info.ref)} ({info.commit[:12]}{version})"


def _render(review: Review, limit: int | None) -> str:
    verdict = review.verdict
    lines = [
        MARKER,
        f"## Review of `patches/`: {review.base.ref} -> {review.head.ref}",
        "",
        f"**{verdict.line}**",
        "",
        f"BASE {_side(review.base)}, HEAD {_side(review.head)}.",
        "",
    ]
    if verdict.sm12x:
        lines += ["SM12x behaviour that changes:", "", *bullets(verdict.sm12x, limit), ""]
    if verdict.other_archs:
        lines += ["sm80-sm103 answers that change:", "", *bullets(verdict.other_archs, limit), ""]
    lines += series_section(review.series, limit)
    if review.upstream is not None:
        lines += base_section(review)
    lines += gates_section(review, limit)
    lines += behaviour_section(review.behaviour, limit)
    lines += checks_section(review.checks, limit)
    return "\n".join(lines).rstrip("\n") + "\n"


def series_section(series: SeriesReview, limit: int | None) -> list[str]:
    lines = ["### Series", ""]
    if not series.patches and not series.reordered:
        return [*lines, f"No patch changed ({len(series.head)} in the series).", ""]
    counts = (
        (len(series.with_status("added")), "added"),
        (len(series.with_status("removed")), "removed"),
        (len(series.with_status("renamed")), "renamed"),
        (len(series.reordered), "reordered"),
        (len(series.with_status("changed")), "changed"),
    )
    tally = ", ".join(f"{n} {what}" for n, what in counts if n)
    lines += [f"{len(series.base)} -> {len(series.head)} patches: {tally}.", ""]
    for move in series.reordered:
        lines.append(
            f"- {code(move.name)} moved from place {move.old_position} to {move.new_position}"
        )
    for name, why in series.unusable:
        lines.append(f"- {code(name)} cannot be read at HEAD: {cell(why)}")
    if series.reordered or series.unusable:
        lines.append("")
    for patch in series.patches:
        lines += _patch(patch, limit)
    return lines


def _patch(patch: PatchReview, limit: int | None) -> list[str]:
    name = code(patch.name)
    if patch.old_name:
        name = f"{code(patch.old_name)} -> {name}"
    if patch.effect in ("same", "refresh", "header-only") and not patch.header:
        note = f" ({cell(patch.note)})" if patch.note else ""
        return [f"- {name}: {EFFECTS[patch.effect]}{note}.", ""]
    lines = [f"#### {name}: {EFFECTS[patch.effect]}", ""]
    if patch.subject:
        lines += [f"{cell(patch.subject)} ({', '.join(code(f) for f in patch.files)})", ""]
    for change in patch.header:
        if change.field == "Description":
            lines.append("- Description: reworded")
        else:
            lines.append(
                f"- {change.field}: {cell(change.old) or '-'} -> {cell(change.new) or '-'}"
            )
    if patch.note:
        lines.append(f"- {cell(patch.note, 400)}")
    if patch.header or patch.note:
        lines.append("")
    if patch.interdiff:
        block = fenced(patch.interdiff, "diff", limit)
        if patch.effect in ("added", "removed"):
            what = "the patch" if patch.effect == "added" else "what dropping it undoes"
            lines += details(f"{what}: {plural(patch.interdiff.count(chr(10)), 'line')}", block)
        else:
            lines += ["Interdiff of the patched file (BASE -> HEAD):", "", *block, ""]
    return lines


def base_section(review: Review) -> list[str]:
    upstream = review.upstream
    assert upstream is not None
    lines = [
        "### Base",
        "",
        f"`vendor/sglang.lock` changed: sglang {upstream.old or '-'} -> {upstream.new or '-'} "
        f"({cell(upstream.old_from) or '-'} -> {cell(upstream.new_from) or '-'}).",
        "",
    ]
    if upstream.report is None:
        return [*lines, "No rebase report names these two releases.", ""]
    lines += [f"Rebase report ({code(upstream.report)}):", ""]
    return [*lines, *bullets(upstream.summary, None), ""]
