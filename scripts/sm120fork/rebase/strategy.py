"""What every carry strategy shares: its frozen context, the patch it carries, its outcome.

A strategy is one function `try_x(ctx, patch) -> Outcome | None` (carry.py
lists them in the order a maintainer would try them). It finds the work tree
clean at `ctx.tip`; it returns an Outcome when it carried or dropped the patch,
and None, with the work tree clean at `ctx.tip` again, when the patch is not
its case. Nothing else passes from one strategy to the next.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from functools import lru_cache
from pathlib import Path

from sm120fork.intent.model import Intent
from sm120fork.patches.applier import ApplyError, Overlay, PatchResult, apply_patch, write_changes
from sm120fork.patches.diffs import FileDiff, Hunk, HunkLine
from sm120fork.patches.normalform import DiffRenderer, render_patch
from sm120fork.patches.patchfile import PatchFile, parse_patch
from sm120fork.rebase.state import Conflict, PatchState, Status, Target
from sm120fork.rebase.workrepo import WorkRepo

_FLIP = {"+": "-", "-": "+", " ": " "}


@dataclass(frozen=True)
class Outcome:
    status: Status
    reason: str  # why, in the tool's words; fate.detail adds what the status means
    commit: str = ""  # the carried patch's commit; "" when dropped or in conflict
    text: str = ""  # its normal form against the tip
    conflicts: tuple[Conflict, ...] = ()
    strategy: str = ""  # the strategy that carried or dropped it ("exact", "3-way", ...)


@dataclass(frozen=True)
class CarryContext:
    repo: WorkRepo  # work tree clean at `tip` on entry
    tip: str
    target: Target  # .version, .base_commit (the new pristine release's commit)
    renderer: DiffRenderer
    intent: Intent | None
    fork_root: Path  # the fork checkout (tests/gates rows live there)
    previous: str  # the patch's commit at the previous release (names.py check)

    @property
    def version(self) -> str:
        return self.target.version


@dataclass(frozen=True)
class CarriedPatch:
    """A patch's state and its parsed text, parsed once (see `carried`)."""

    state: PatchState
    parsed: PatchFile

    @property
    def name(self) -> str:
        return self.state.name


Strategy = Callable[[CarryContext, CarriedPatch], "Outcome | None"]


def carried(patch: PatchState) -> CarriedPatch:
    return CarriedPatch(patch, parsed(patch))


def parsed(patch: PatchState) -> PatchFile:
    """The patch's text parsed; the same text (at the same release or the next ones,
    in prepare, carry, --continue) is parsed once per rebase."""
    return _parse(patch.text, patch.name, patch.strip)


@lru_cache(maxsize=256)
def _parse(text: str, name: str, strip: int) -> PatchFile:
    return parse_patch(text.encode("utf-8"), name, strip)


def finish(
    ctx: CarryContext, patch: PatchFile, status: Status, reason: str, strategy: str
) -> Outcome:
    """Commit the work tree's change as `patch` on the tip and render it in normal form
    (an empty change: dropped as upstreamed, the work tree back at the tip)."""
    repo = ctx.repo
    commit = repo.commit_worktree(patch.name)
    if commit is None:
        repo.checkout(ctx.tip)
        return Outcome("upstreamed", "carrying it leaves an empty diff", strategy=strategy)
    paths = repo.changed_paths(ctx.tip, commit)
    before = {path: repo.read(ctx.tip, path) for path in paths}
    after = {path: repo.read(commit, path) for path in paths}
    text = render_patch(patch.header, ctx.renderer.diff(before, after)).decode("utf-8")
    return Outcome(status, reason, commit, text, strategy=strategy)


def apply_to_worktree(
    repo: WorkRepo, patch: PatchFile, *, allow_offset: bool
) -> PatchResult | None:
    """Apply `patch` to the work tree; None (and nothing written) if it does not apply."""
    overlay = Overlay(repo.root)
    try:
        result = apply_patch(overlay, patch, allow_offset=allow_offset)
    except ApplyError:
        return None
    write_changes(repo.root, overlay.changes)
    return result


def applies(repo: WorkRepo, patch: PatchFile, *, allow_offset: bool) -> bool:
    """Whether `patch` applies to the work tree (nothing is written)."""
    try:
        apply_patch(Overlay(repo.root), patch, allow_offset=allow_offset)
    except ApplyError:
        return False
    return True


def reverse(patch: PatchFile) -> PatchFile:
    """The patch that undoes `patch`."""
    return replace(patch, files=tuple(_reverse_file(f) for f in patch.files))


def _reverse_file(diff: FileDiff) -> FileDiff:
    hunks = tuple(
        Hunk(
            old_start=h.new_start,
            old_count=h.new_count,
            new_start=h.old_start,
            new_count=h.old_count,
            section=h.section,
            lines=tuple(HunkLine(_FLIP[line.tag], line.text) for line in h.lines),
            lineno=h.lineno,
        )
        for h in diff.hunks
    )
    return replace(diff, old_path=diff.new_path, new_path=diff.old_path, hunks=hunks)
