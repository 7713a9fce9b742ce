"""Review of a change to `patches/`: what the patched sglang now does differently.

    review = review_change(root, "main", "HEAD")   # BASE, HEAD
    write(review, Path("build/review"))            # review.md (a PR comment), review.json

The steps, as a reviewer would take them by hand: read both sides from git
(never checking anything out), apply each series to the upstream files it
touches, compare the series patch by patch (interdiffs of the patched files),
compare the gate policies, scan the gates of both patched trees, compare the
expectation tables, run `check` on HEAD, and say first what changes for SM12x.
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable
from pathlib import Path

from sm120fork.gates.policy import policy_from_text
from sm120fork.patches.normalform import DiffRenderer
from sm120fork.review import decisions, revs
from sm120fork.review.behaviour import review_behaviour
from sm120fork.review.gatescan import scan_patched
from sm120fork.review.headcheck import check_head
from sm120fork.review.model import Review, RevInfo
from sm120fork.review.patched import apply_series
from sm120fork.review.seriesdiff import review_series
from sm120fork.review.side import EXPECTATIONS, POLICY, Side, load_side, pristine
from sm120fork.review.upstream import review_upstream
from sm120fork.review.verdict import decide


def _info(side: Side) -> RevInfo:
    return RevInfo(side.rev.ref, side.rev.commit, side.version)


def review_change(
    root: Path,
    base_ref: str | None,
    head_ref: str = "HEAD",
    *,
    full_scan: bool = False,
    workers: int | None = None,
    progress: Callable[[str], None] = lambda message: None,
) -> Review:
    revs.require_clean(root)
    head_rev = revs.resolve(root, head_ref)
    base_rev = revs.resolve(root, base_ref) if base_ref else revs.default_base(root, head_rev)
    revs.require_ancestor(root, base_rev, head_rev)
    base, head = load_side(root, base_rev), load_side(root, head_rev)

    touched = tuple(dict.fromkeys((*base.touched, *head.touched)))
    progress(f"applying both series to the {len(touched)} upstream files they touch")
    base_files, head_files = pristine(root, base, touched), pristine(root, head, touched)
    base_applied = apply_series(base.patches, base_files)
    head_applied = apply_series(head.patches, head_files)
    with DiffRenderer() as renderer:
        series = review_series(base, head, base_applied, head_applied, renderer)

    base_policy = policy_from_text(base.policy, f"{POLICY} at {base.rev.ref}")
    head_policy = policy_from_text(head.policy, f"{POLICY} at {head.rev.ref}")
    full = full_scan or base.vendor != head.vendor
    progress(
        "scanning the gates of both patched trees" + ("" if full else f" ({len(touched)} files)")
    )
    with tempfile.TemporaryDirectory(prefix="sm120fork-review-") as scratch:
        gates = scan_patched(
            root,
            Path(scratch),
            ((base, base_applied.final, base_policy), (head, head_applied.final, head_policy)),
            full=full,
            workers=workers,
        )
        progress("checking HEAD's series")
        checks = check_head(Path(scratch) / "check", head, head_files)
    behaviour = review_behaviour(base.expectations, head.expectations, head.names, EXPECTATIONS)
    return Review(
        base=_info(base),
        head=_info(head),
        verdict=decide(behaviour, gates, checks),
        series=series,
        upstream=review_upstream(root, base, head),
        decisions=decisions.changes(base_policy, head_policy),
        gates=gates,
        behaviour=behaviour,
        checks=checks,
    )
