"""The series from BASE to HEAD: patches added, removed, renamed, reordered, changed.

A renamed patch is a removed name and an added one changing the same files
in much the same way; it is then reviewed like a changed patch. Reordered
patches are those outside the longest run of patches kept in the same order.
"""

from __future__ import annotations

from difflib import SequenceMatcher

from sm120fork.patches.normalform import DiffRenderer
from sm120fork.review import interdiff
from sm120fork.review.model import Move, PatchReview, SeriesReview
from sm120fork.review.patched import Applied
from sm120fork.review.side import Side

RENAME_MIN = 0.5  # a renamed patch's diff is at least this similar to the old one's


def review_series(
    base: Side, head: Side, old: Applied, new: Applied, renderer: DiffRenderer
) -> SeriesReview:
    gone = [n for n in base.names if n not in head.names]
    renames = _renames(base, head, gone, [n for n in head.names if n not in base.names])
    patches: list[PatchReview] = []
    for name in head.names:
        patch = head.patch(name)
        if patch is None:
            continue  # unusable: HEAD's check names it
        old_name = renames.get(name, name if name in base.names else None)
        before = base.patch(old_name) if old_name else None
        if before is None:
            patches.append(interdiff.added(patch, new.steps[name], renderer))
            continue
        review = interdiff.changed(before, patch, old.steps[before.name], new.steps[name], renderer)
        if review is not None:
            patches.append(review)
    renamed = set(renames.values())
    for name in gone:
        patch = base.patch(name)
        if patch is not None and name not in renamed:
            patches.append(interdiff.removed(patch, old.steps[name], renderer))
    return SeriesReview(
        base=base.names,
        head=head.names,
        patches=tuple(patches),
        reordered=_moves(base.names, head.names, renames),
        unusable=head.unusable,
    )


def _renames(base: Side, head: Side, gone: list[str], new: list[str]) -> dict[str, str]:
    """new name -> old name, for each added patch that is a removed one renamed."""
    candidates = []
    for old_name in gone:
        old = base.patch(old_name)
        for new_name in new:
            patch = head.patch(new_name)
            if old is None or patch is None or set(old.paths) != set(patch.paths):
                continue
            a, b = interdiff.diff_part(old), interdiff.diff_part(patch)
            ratio = 1.0 if a == b else SequenceMatcher(None, a, b, autojunk=False).ratio()
            if ratio >= RENAME_MIN:
                candidates.append((ratio, old_name, new_name))
    renames: dict[str, str] = {}
    for _, old_name, new_name in sorted(candidates, key=lambda c: -c[0]):
        if new_name not in renames and old_name not in renames.values():
            renames[new_name] = old_name
    return renames


def _moves(old: tuple[str, ...], new: tuple[str, ...], renames: dict[str, str]) -> tuple[Move, ...]:
    back = {o: n for n, o in renames.items()}
    old_named = [back.get(name, name) for name in old]
    common = set(old_named) & set(new)
    a = [n for n in old_named if n in common]
    b = [n for n in new if n in common]
    kept = _lcs(a, b)
    return tuple(
        Move(name, old_named.index(name) + 1, new.index(name) + 1) for name in b if name not in kept
    )


def _lcs(a: list[str], b: list[str]) -> set[str]:
    """The names of a longest common subsequence of `a` and `b`."""
    table = [[0] * (len(b) + 1) for _ in range(len(a) + 1)]
    for i in range(len(a) - 1, -1, -1):
        for j in range(len(b) - 1, -1, -1):
            table[i][j] = (
                table[i + 1][j + 1] + 1 if a[i] == b[j] else max(table[i + 1][j], table[i][j + 1])
            )
    kept, i, j = set(), 0, 0
    while i < len(a) and j < len(b):
        if a[i] == b[j]:
            kept.add(a[i])
            i, j = i + 1, j + 1
        elif table[i + 1][j] >= table[i][j + 1]:
            i += 1
        else:
            j += 1
    return kept
