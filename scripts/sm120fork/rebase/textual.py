"""The strategies that only apply the patch's text: exactly, undone, at shifted lines."""

from __future__ import annotations

from pathlib import PurePosixPath

from sm120fork.patches.applier import PatchResult
from sm120fork.rebase.strategy import (
    CarriedPatch,
    CarryContext,
    Outcome,
    applies,
    apply_to_worktree,
    finish,
    reverse,
)


def try_exact(ctx: CarryContext, patch: CarriedPatch) -> Outcome | None:
    """It applies exactly -> clean."""
    if apply_to_worktree(ctx.repo, patch.parsed, allow_offset=False) is None:
        return None
    why = f"applies unchanged to {ctx.version}"
    return finish(ctx, patch.parsed, "clean", why, "exact", paths=patch.parsed.paths)


def try_reverse(ctx: CarryContext, patch: CarriedPatch) -> Outcome | None:
    """It reverse-applies exactly: upstream made it -> upstreamed."""
    if not applies(ctx.repo, reverse(patch.parsed), allow_offset=False):
        return None
    why = f"upstream {ctx.version} already makes this change (the patch reverse-applies)"
    return Outcome("upstreamed", why, strategy="reverse")


def try_offset(ctx: CarryContext, patch: CarriedPatch) -> Outcome | None:
    """It applies at shifted lines -> offset (refreshed)."""
    shifted = apply_to_worktree(ctx.repo, patch.parsed, allow_offset=True)
    if shifted is None:
        return None
    reason = f"applies to {ctx.version} at shifted lines ({_offsets(shifted)}); refreshed"
    return finish(ctx, patch.parsed, "offset", reason, "offset", paths=patch.parsed.paths)


def try_reverse_offset(ctx: CarryContext, patch: CarriedPatch) -> Outcome | None:
    """The 3-way merge conflicted, but the patch reverse-applies at shifted lines
    -> upstreamed."""
    if not applies(ctx.repo, reverse(patch.parsed), allow_offset=True):
        return None
    why = (
        f"upstream {ctx.version} already makes this change at shifted lines (the 3-way merge "
        "conflicted, but the patch reverse-applies)"
    )
    return Outcome("upstreamed", why, strategy="reverse-offset")


def _offsets(result: PatchResult) -> str:
    return ", ".join(
        f"{PurePosixPath(path).name} " + " ".join(f"{o:+d}" for o in offsets if o)
        for path, offsets in result.offsets.items()
        if any(offsets)
    )
