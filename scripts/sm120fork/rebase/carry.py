"""Carry one patch onto the work tree's tip, trying what a maintainer would, in order:

1. it applies exactly                          -> clean
2. it reverse-applies: upstream made it        -> upstreamed (dropped)
3. it applies at shifted lines                 -> offset (refreshed)
4. its declared intent (patches/intents.toml), re-applied to the new code,
   finds the gate already admitting SM12x      -> upstreamed
   or rewrites it                              -> resolved (the recipe keeps
                                                  reproducing the patch, as check wants)
5. `git cherry-pick`, a real 3-way merge       -> merged, or upstreamed if the
                                                  result changes nothing; a conflict
                                                  that is only a re-worded comment
                                                  beside the patch or one import both
                                                  sides changed -> merged (cosmetic.py)
6. the merge conflicts but the change is already
   upstream at shifted lines                   -> upstreamed
7. otherwise                                   -> conflict (markers left in the work tree)

Whatever the route, a carried patch whose own added lines now use a name the
new upstream no longer defines (or no longer parse) is a conflict too, with its
change left uncommitted in the work tree for a person (names.py).

A carried patch is committed on the tip and re-rendered in normal form
against it, with its original header (landing decides Last-Update).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path, PurePosixPath

from sm120fork.intent.model import Intent
from sm120fork.intent.reapply import Reapplied, reapply
from sm120fork.patches.applier import ApplyError, Overlay, PatchResult, apply_patch
from sm120fork.patches.diffs import FileDiff, Hunk, HunkLine
from sm120fork.patches.normalform import DiffRenderer, render_patch
from sm120fork.patches.patchfile import PatchFile, parse_patch
from sm120fork.rebase import behaviour, cosmetic
from sm120fork.rebase.conflicts import describe
from sm120fork.rebase.names import broken_lines
from sm120fork.rebase.state import Conflict, PatchState, Status, Target
from sm120fork.rebase.workrepo import WorkRepo
from sm120fork.rebase.workspace import say

_FLIP = {"+": "-", "-": "+", " ": " "}


@dataclass(frozen=True)
class Outcome:
    status: Status
    reason: str  # why, in the tool's words; fate.detail adds what the status means
    commit: str = ""  # the carried patch's commit; "" when dropped or in conflict
    text: str = ""  # its normal form against the tip
    conflicts: tuple[Conflict, ...] = ()


def carry(
    repo: WorkRepo,
    patch: PatchState,
    tip: str,
    target: Target,
    renderer: DiffRenderer,
    intent: Intent | None = None,
    fork_root: Path | None = None,
) -> Outcome:
    """Carry `patch` onto `tip` (the work tree, clean at `tip`) at release `target`
    (`fork_root`: the fork's checkout, whose gate rows behaviour.py runs)."""
    version = target.version
    parsed = parse_patch(patch.text.encode("utf-8"), patch.name, patch.strip)
    if apply_to_worktree(repo, parsed, allow_offset=False) is not None:
        return finish(repo, parsed, tip, renderer, "clean", f"applies unchanged to {version}")
    if _applies(repo, reverse(parsed), allow_offset=False):
        return _dropped(f"upstream {version} already makes this change (the patch reverse-applies)")
    shifted = apply_to_worktree(repo, parsed, allow_offset=True)
    if shifted is not None:
        reason = f"applies to {version} at shifted lines ({_offsets(shifted)}); refreshed"
        return finish(repo, parsed, tip, renderer, "offset", reason)
    verdict = _reapply(repo, intent) if intent is not None else None
    if verdict is not None and verdict.status == "upstreamed":
        return _dropped(f"{verdict.detail} in {version}")
    upstream_elsewhere = _applies(repo, reverse(parsed), allow_offset=True)
    merged = repo.cherry_pick(patch.commit)
    if verdict is not None and verdict.status == "resolved":
        return _by_intent(repo, parsed, tip, target, renderer, verdict, merged)
    if merged:
        files = ", ".join(PurePosixPath(f.path).name for f in parsed.files)
        reason = f"git merged it 3-way with upstream {version}'s changes to {files}; refreshed"
        outcome = finish(repo, parsed, tip, renderer, "merged", reason)
        if outcome.status == "upstreamed":
            return _dropped(
                f"upstream {version} already makes this change (the 3-way merge leaves an "
                "empty diff)"
            )
        return outcome
    if upstream_elsewhere:
        repo.checkout(tip)
        return _dropped(
            f"upstream {version} already makes this change at shifted lines (the 3-way merge "
            "conflicted, but the patch reverse-applies)"
        )
    conflicts = describe(repo, tip, target.base_commit, parsed)
    kinds = _resolve_cosmetic(repo)
    if kinds:
        where = ", ".join(f"{PurePosixPath(c.file).name}:{c.line}" for c in conflicts)
        reason = (
            f"the 3-way merge onto {version} conflicted only where {' and '.join(kinds)} "
            f"({where}); the tool kept both sides' changes (cosmetic.py); refreshed"
        )
        return replace(finish(repo, parsed, tip, renderer, "merged", reason), conflicts=())
    judged = _behaviour(repo, target, parsed, fork_root)
    if judged is not None and judged[0]:
        repo.checkout(tip)
        return _dropped(judged[1])
    reason = _conflicts_detail(target.version, conflicts)
    if verdict is not None:
        reason += f"; its intent did not help: {verdict.detail}"
    if judged is not None:
        reason += f"; its gate rows did not settle it: {judged[1]}"
    return Outcome("conflict", reason, conflicts=conflicts)


@dataclass(frozen=True)
class _Judged:
    """What behaviour.judge reads (until carry's strategies take a CarryContext)."""

    repo: WorkRepo
    target: Target
    fork_root: Path
    parsed: PatchFile

    @property
    def name(self) -> str:
        return self.parsed.name


def _behaviour(
    repo: WorkRepo, target: Target, parsed: PatchFile, fork_root: Path | None
) -> tuple[bool, str] | None:
    if fork_root is None:
        return None
    context = _Judged(repo, target, fork_root, parsed)
    return behaviour.judge(context, context, say)


def _by_intent(
    repo: WorkRepo,
    patch: PatchFile,
    tip: str,
    target: Target,
    renderer: DiffRenderer,
    verdict: Reapplied,
    merged: bool,
) -> Outcome:
    """The patch as its intent makes it on the new code (so the recipe keeps reproducing
    the patch); the conflicts a 3-way merge would have left are kept for the report."""
    conflicts = () if merged else describe(repo, tip, target.base_commit, patch)
    merge = _conflicts_detail(target.version, conflicts) if conflicts else "git would merge it"
    repo.checkout(tip)
    for path, text in verdict.changes.items():
        (repo.root / path).write_bytes(text.encode("utf-8"))
    reason = f"{verdict.detail} (its text no longer applies; {merge}); refreshed"
    return replace(finish(repo, patch, tip, renderer, "resolved", reason), conflicts=conflicts)


def checked(repo: WorkRepo, tip: str, outcome: Outcome, version: str, before: str) -> Outcome:
    """`outcome`, or a conflict if the carried change breaks names (names.py; `before`:
    the patch's commit at the previous release); the change then stays in the work
    tree, uncommitted, for a person to fix."""
    if not outcome.commit:
        return outcome
    broken = broken_lines(repo, tip, outcome.commit, before)
    if not broken:
        return outcome
    repo.git("reset", "-q", "--mixed", tip)
    found = "; ".join(b.describe() for b in broken)
    reason = (
        f"it was carried ({outcome.status}), but its own lines break on {version}: {found}; "
        "upstream no longer defines what they use"
    )
    conflicts = tuple(Conflict(b.file, b.line, False, b.text, b.problem) for b in broken)
    return Outcome("conflict", reason, conflicts=conflicts)


def _resolve_cosmetic(repo: WorkRepo) -> list[str]:
    """Resolve the stopped merge if every conflict is of a kind cosmetic.py resolves;
    the kinds met, sorted (none: nothing was written)."""
    resolved: dict[str, str] = {}
    kinds: set[str] = set()
    for path in repo.unmerged():
        file = repo.root / path
        merged = cosmetic.resolve_text(file.read_text("utf-8")) if file.is_file() else None
        if merged is None:
            return []
        resolved[path] = merged[0]
        kinds |= merged[1]
    for path, text in resolved.items():
        (repo.root / path).write_bytes(text.encode("utf-8"))
    return sorted(kinds)


def _conflicts_detail(version: str, conflicts: tuple[Conflict, ...]) -> str:
    where = ", ".join(f"{PurePosixPath(c.file).name}:{c.line}" for c in conflicts)
    count = f"{len(conflicts)} place{'s' if len(conflicts) != 1 else ''}"
    return f"the 3-way merge onto {version} conflicts in {count} ({where})"


def _dropped(why: str) -> Outcome:
    return Outcome("upstreamed", why)


def finish(
    repo: WorkRepo,
    patch: PatchFile,
    tip: str,
    renderer: DiffRenderer,
    status: Status,
    reason: str,
) -> Outcome:
    """Commit the work tree's change as `patch` on `tip` and render it in normal form."""
    commit = repo.commit_worktree(patch.name)
    if commit is None:
        repo.checkout(tip)
        return _dropped("carrying it leaves an empty diff")
    paths = repo.changed_paths(tip, commit)
    before = {path: repo.read(tip, path) for path in paths}
    after = {path: repo.read(commit, path) for path in paths}
    text = render_patch(patch.header, renderer.diff(before, after)).decode("utf-8")
    return Outcome(status, reason, commit, text)


def _reapply(repo: WorkRepo, intent: Intent) -> Reapplied:
    """The intent re-applied to the work tree's files (nothing is written)."""

    def read(path: str) -> str | None:
        file = repo.root / path
        return file.read_text("utf-8") if file.is_file() else None

    return reapply(intent, read, [path for path in repo.files() if path.endswith(".py")])


def apply_to_worktree(
    repo: WorkRepo, patch: PatchFile, *, allow_offset: bool
) -> PatchResult | None:
    """Apply `patch` to the work tree; None (and nothing written) if it does not apply."""
    overlay = Overlay(repo.root)
    try:
        result = apply_patch(overlay, patch, allow_offset=allow_offset)
    except ApplyError:
        return None
    for path, text in overlay.changes.items():
        target = repo.root / path
        if text is None:
            target.unlink()
        else:
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(text.encode("utf-8"))
    return result


def _applies(repo: WorkRepo, patch: PatchFile, *, allow_offset: bool) -> bool:
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


def _offsets(result: PatchResult) -> str:
    return ", ".join(
        f"{PurePosixPath(path).name} " + " ".join(f"{o:+d}" for o in offsets if o)
        for path, offsets in result.offsets.items()
        if any(offsets)
    )
