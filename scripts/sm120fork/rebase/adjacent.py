"""Conflict blocks whose two sides changed different lines of the old upstream.

Git stops a 3-way merge when the two sides' changes merely touch: upstream
changed the line just below the patch's (0.5.11 made `sm_scale` optional one
line under the triton tile choice), or upstream re-wrote a docstring into
fewer lines right above the patch's lines (0.5.21, `_mla_kv_cache_dtype_checks`).
Inside one diff3 block, each side's changes are matched to the base lines
they replace. When no base line is changed by both sides, both changes are
kept, in base order. Two insertions at the same point have no order such a
merge can know: `merged(..., same_point=True)` keeps both, upstream's first,
an order chosen by rule that the gate rows then judge (0.5.12 and 0.5.16
inserted upstream's own early return or rule exactly where the patch's begins).

Upstream changing or removing a line that opens a block (`if ...:`, `def ...:`)
or tests the architecture is never merged this way: the patch's lines may
live under that condition, and whether they still belong there is a
judgement (0.5.13 renamed the NSA test the guard sits under).
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass

from sm120fork.rebase.conflicts import is_gate_text


@dataclass(frozen=True)
class Change:
    start: int  # the base lines it replaces: [start, end)
    end: int
    lines: tuple[str, ...]
    upstream: bool  # ours (the new upstream) rather than theirs (the patch)
    at: int  # where `lines` start in that side

    def clashes(self, other: Change, *, same_point: bool) -> bool:
        if self.start < other.end and other.start < self.end:
            return True  # both change some base line
        if self.start == self.end == other.start == other.end:
            return not same_point  # both insert at one point
        return any(
            c.start == c.end and o.start < c.start < o.end
            for c, o in ((self, other), (other, self))
        )  # an insertion inside the other's change


def changes(base: list[str], side: list[str], *, upstream: bool) -> list[Change]:
    matcher = difflib.SequenceMatcher(a=base, b=side, autojunk=False)
    return [
        Change(b1, b2, tuple(side[s1:s2]), upstream, s1)
        for tag, b1, b2, s1, s2 in matcher.get_opcodes()
        if tag != "equal"
    ]


def merged(
    ours: list[str], base: list[str], theirs: list[str], *, same_point: bool
) -> list[str] | None:
    """Both sides' changes applied to base, or None if some base line is changed by both
    (or, unless `same_point`, both insert at one point)."""
    upstream = changes(base, ours, upstream=True)
    patch = changes(base, theirs, upstream=False)
    if not upstream or not patch:
        return None
    prose = _prose(base)
    if any(_opens_or_gates(base[u.start : u.end], prose[u.start : u.end]) for u in upstream):
        return None
    if any(u.clashes(p, same_point=same_point) for u in upstream for p in patch):
        return None
    out: list[str] = []
    position = 0
    # Base order; at one point an insertion goes first, and upstream's before the patch's.
    for change in sorted(upstream + patch, key=lambda c: (c.start, c.end, not c.upstream)):
        out.extend(base[position : change.start])
        out.extend(change.lines)
        position = max(position, change.end)
    out.extend(base[position:])
    return out


SAME_LINES = "both sides change the same lines"
CONDITION = (
    "upstream changed a line that opens a block or tests the architecture, next to the patch's"
)


def why_not(ours: list[str], base: list[str], theirs: list[str]) -> str:
    """Why `merged` refuses a block (or some other rule's shape was not met)."""
    upstream = changes(base, ours, upstream=True)
    patch = changes(base, theirs, upstream=False)
    if any(u.clashes(p, same_point=True) for u in upstream for p in patch):
        return SAME_LINES
    prose = _prose(base)
    if any(_opens_or_gates(base[u.start : u.end], prose[u.start : u.end]) for u in upstream):
        return CONDITION
    return "no rule fits its shape"


def _opens_or_gates(lines: list[str], prose: list[bool]) -> bool:
    """Whether any line of code (not prose) opens a block or tests the GPU architecture."""
    return any(
        _code(line).endswith(":") or is_gate_text(line)
        for line, words in zip(lines, prose, strict=True)
        if not words
    )


def _code(line: str) -> str:
    return line.split("#", 1)[0].rstrip()


def same_point_insertions(ours: list[str], base: list[str], theirs: list[str]) -> bool:
    """Whether both sides insert at one point of base (what makes an order a rule's)."""
    upstream = changes(base, ours, upstream=True)
    patch = changes(base, theirs, upstream=False)
    return any(u.start == u.end == p.start == p.end for u in upstream for p in patch)


def prose_only(ours: list[str], base: list[str]) -> bool:
    """Whether upstream's changes in the block touch only comments, docstrings and blank
    lines (on both the old and the new side)."""
    old, new = _prose(base), _prose(ours)
    return all(
        all(old[c.start : c.end]) and all(new[c.at : c.at + len(c.lines)])
        for c in changes(base, ours, upstream=True)
    )


def _prose(lines: list[str]) -> list[bool]:
    """Per line: blank, a comment, or part of a triple-quoted string statement. A block
    that starts inside a docstring is not known to: its lines count as code."""
    found: list[bool] = []
    inside = ""  # the open triple quote, if any
    for line in lines:
        text = line.strip()
        if inside:
            found.append(True)
            if text.count(inside) % 2:
                inside = ""
            continue
        quote = next((q for q in ('"""', "'''") if text.lstrip("rRbBuU").startswith(q)), "")
        if quote:
            found.append(True)
            if text.count(quote) == 1:
                inside = quote
            continue
        found.append(not text or text.startswith("#"))
    return found
