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
from pathlib import Path

from sm120fork.errors import FatalError
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
    renames: tuple[tuple[str, str], ...] = ()  # functions its intent followed to new names


@dataclass(frozen=True)
class CarryContext:
    repo: WorkRepo  # work tree clean at `tip` on entry
    tip: str
    target: Target  # .version, .base_commit (the new pristine release's commit)
    renderer: DiffRenderer
    intent: Intent | None
    fork_root: Path  # the fork checkout (its gatetable/ rows live there)
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
    """The patch's text parsed: each text once per process, wherever it is needed
    (loading the series, prepare, each release's carry, --continue, landing)."""
    key = (patch.text, patch.name, patch.strip)
    if key not in _PARSED:
        _PARSED[key] = parse_patch(patch.text.encode("utf-8"), patch.name, patch.strip)
    return _PARSED[key]


def state_of(file: PatchFile) -> PatchState:
    """A patch of the series as the rebase starts it, its parse kept for `parsed`."""
    text = file.raw.decode("utf-8")
    _PARSED[(text, file.name, file.strip)] = file
    return PatchState(file.name, file.strip, text=text)


_PARSED: dict[tuple[str, str, int], PatchFile] = {}  # (text, name, strip) -> its parse


def finish(
    ctx: CarryContext,
    patch: PatchFile,
    status: Status,
    reason: str,
    strategy: str,
    *,
    paths: tuple[str, ...] | None = None,
) -> Outcome:
    """Commit the work tree's change as `patch` on the tip and render it in normal form
    (an empty change: dropped as upstreamed, the work tree back at the tip). `paths`:
    the only files the strategy wrote, when it knows them."""
    repo = ctx.repo
    commit = repo.commit_worktree(patch.name, paths)
    if commit is None:
        repo.checkout(ctx.tip)
        return Outcome("upstreamed", "carrying it leaves an empty diff", strategy=strategy)
    changed = repo.changed_paths(ctx.tip, commit)
    before = {path: repo.read(ctx.tip, path) for path in changed}
    after = {path: repo.read(commit, path) for path in changed}
    text = render_patch(patch.header, ctx.renderer.diff(before, after)).decode("utf-8")
    return Outcome(status, reason, commit, text, strategy=strategy)


def text_of(overlay: Overlay, path: str) -> str:
    """The file's text; "" when absent, or not text the tool may read (a link out of
    the tree, not UTF-8): such a file is no place code moved to."""
    try:
        return overlay.read(path) or ""
    except FatalError:
        return ""


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
