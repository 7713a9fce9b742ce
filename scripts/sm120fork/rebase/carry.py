"""Carry one patch onto the work tree's tip: the strategies, in the order a maintainer
would try them. Each is one function `try_x(ctx, patch) -> Outcome | None`
(strategy.py): the first that returns an Outcome decides, and names itself in
it (`Outcome.strategy`, shown per release by the report and the CHANGELOG).

Whatever the route, a carried patch whose own added lines now use a name the
new upstream no longer defines (or no longer parse) is checked once more: a
removed `is_smNNN_supported()` helper is rewritten to the platform object
upstream now uses, where that is unambiguous (platformhelper.py); anything
else is a conflict, with the change left uncommitted for a person (names.py).

A carried patch is committed on the tip and re-rendered in normal form
against it, with its original header (landing decides Last-Update).
"""

from __future__ import annotations

from dataclasses import replace

from sm120fork.rebase import platformhelper
from sm120fork.rebase.merge import conflict, try_intent, try_resolutions, try_three_way
from sm120fork.rebase.names import broken_lines
from sm120fork.rebase.relocate import try_relocate
from sm120fork.rebase.state import Conflict
from sm120fork.rebase.strategy import CarriedPatch, CarryContext, Outcome, Strategy
from sm120fork.rebase.textual import try_exact, try_offset, try_reverse, try_reverse_offset

STRATEGIES: tuple[Strategy, ...] = (
    try_exact,  # "exact": applies unchanged -> clean
    try_reverse,  # "reverse": reverse-applies, upstream made it -> upstreamed
    try_offset,  # "offset": applies at shifted lines -> offset
    try_intent,  # "intent": its intents.toml recipe -> upstreamed or resolved
    try_three_way,  # "3-way": git cherry-pick merges it -> merged (empty: upstreamed)
    try_reverse_offset,  # "reverse-offset": conflicts, but reverse-applies -> upstreamed
    try_relocate,  # "relocate": its code left the file; re-applied where it went -> merged
    try_resolutions,  # "docstring", "import-list", "adjacent-edits", "two-insertions",
    #                   "deleted-file" (joined by +): every conflict a rule's -> merged
)


def carry(ctx: CarryContext, patch: CarriedPatch) -> Outcome:
    """Carry `patch` onto `ctx.tip` at release `ctx.target`: the first strategy's
    outcome, checked for broken names; else a conflict for a person."""
    for strategy in STRATEGIES:
        outcome = strategy(ctx, patch)
        if outcome is not None:
            return checked(ctx, patch, outcome)
    return conflict(ctx, patch)


def checked(ctx: CarryContext, patch: CarriedPatch, outcome: Outcome) -> Outcome:
    """`outcome`, its lines rewritten where a platform helper left (platformhelper.py),
    or a conflict if the carried change breaks names (names.py); the change then stays
    in the work tree, uncommitted, for a person to fix."""
    if not outcome.commit:
        return outcome
    broken = broken_lines(ctx.repo, ctx.tip, outcome.commit, ctx.previous)
    if not broken:
        return outcome
    repaired = platformhelper.rewrite(ctx, patch, outcome, broken)
    if repaired is not None:
        return repaired
    ctx.repo.git("reset", "-q", "--mixed", ctx.tip)
    found = "; ".join(b.describe() for b in broken)
    reason = (
        f"it was carried ({outcome.status}, by {outcome.strategy}), but its own lines break "
        f"on {ctx.version}: {found}; upstream no longer defines what they use"
    )
    conflicts = tuple(Conflict(b.file, b.line, False, b.text, b.problem) for b in broken)
    return replace(Outcome("conflict", reason, conflicts=conflicts), strategy="none")
