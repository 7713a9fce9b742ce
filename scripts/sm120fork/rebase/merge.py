"""The strategies built on `git cherry-pick`: the intent, the 3-way merge, the
automatic resolutions of its conflicts, and the final conflict for a person."""

from __future__ import annotations

from dataclasses import replace
from pathlib import PurePosixPath

from sm120fork.intent import renames
from sm120fork.intent.proofcache import reapply_kept
from sm120fork.intent.reapply import Reapplied
from sm120fork.patches.applier import write_changes
from sm120fork.rebase import resolutions
from sm120fork.rebase.conflicts import describe
from sm120fork.rebase.state import Conflict
from sm120fork.rebase.strategy import CarriedPatch, CarryContext, Outcome, finish


def try_intent(ctx: CarryContext, patch: CarriedPatch) -> Outcome | None:
    """Its declared intent (patches/intents.toml), re-applied to the new code, finds the
    gate already admitting SM12x -> upstreamed, or rewrites it -> resolved (so the
    recipe keeps reproducing the patch, as check wants); the conflicts a 3-way merge
    would have left are kept for the report."""
    verdict, renamed = _reapplied(ctx)
    if verdict is None or verdict.status not in ("upstreamed", "resolved"):
        return None
    if verdict.status == "upstreamed":
        return Outcome("upstreamed", f"{verdict.detail} in {ctx.version}", strategy="intent")
    merged = ctx.repo.cherry_pick(patch.state.commit)
    conflicts = () if merged else _described(ctx, patch)
    merge = _conflicts_detail(ctx.version, conflicts) if conflicts else "git would merge it"
    ctx.repo.checkout(ctx.tip)
    write_changes(ctx.repo.root, verdict.changes)
    reason = f"{verdict.detail} (its text no longer applies; {merge}); refreshed"
    outcome = finish(ctx, patch.parsed, "resolved", reason, "intent")
    return replace(outcome, conflicts=conflicts, renames=tuple(sorted(renamed.items())))


def try_three_way(ctx: CarryContext, patch: CarriedPatch) -> Outcome | None:
    """`git cherry-pick`, a real 3-way merge -> merged, or upstreamed if the result
    changes nothing."""
    if not ctx.repo.cherry_pick(patch.state.commit):
        ctx.repo.checkout(ctx.tip)
        return None
    files = ", ".join(PurePosixPath(f.path).name for f in patch.parsed.files)
    reason = f"git merged it 3-way with upstream {ctx.version}'s changes to {files}; refreshed"
    outcome = finish(ctx, patch.parsed, "merged", reason, "3-way")
    if outcome.status == "upstreamed":
        why = (
            f"upstream {ctx.version} already makes this change (the 3-way merge leaves an "
            "empty diff)"
        )
        return replace(outcome, reason=why)
    return outcome


def try_resolutions(ctx: CarryContext, patch: CarriedPatch) -> Outcome | None:
    """The 3-way merge conflicts only in ways resolutions.py resolves by rule -> merged;
    the strategy is named by the rules used ("docstring", "import-list+two-insertions")."""
    if ctx.repo.cherry_pick(patch.state.commit):
        ctx.repo.checkout(ctx.tip)  # try_three_way's case, not ours
        return None
    conflicts = _described(ctx, patch)
    resolved = resolutions.resolve_worktree(ctx.repo)
    if resolved is None or set(patch.parsed.paths) <= set(resolved.deleted):
        ctx.repo.checkout(ctx.tip)  # none, or nothing of the patch would be left: a judgement
        return None
    where = ", ".join(f"{PurePosixPath(c.file).name}:{c.line}" for c in conflicts)
    reason = (
        f"the 3-way merge onto {ctx.version} conflicted only where "
        f"{' and '.join(resolved.phrases)} ({where}); the tool resolved it by rule; refreshed"
    )
    return finish(ctx, patch.parsed, "merged", reason, "+".join(resolved.kinds))


def conflict(ctx: CarryContext, patch: CarriedPatch) -> Outcome:
    """The last resort, always an outcome: the conflict markers stay in the work tree
    for a person, the reason says why no rule could decide."""
    verdict, _ = _reapplied(ctx)  # read before the merge writes its markers
    ctx.repo.cherry_pick(patch.state.commit)
    conflicts = _described(ctx, patch)
    reason = _conflicts_detail(ctx.version, conflicts)
    why = resolutions.why_not(ctx.repo)
    if why:
        reason += f"; a judgement, not a rule: {why}"
    if verdict is not None:
        reason += f"; its intent did not help: {verdict.detail}"
    return Outcome("conflict", reason, conflicts=conflicts, strategy="none")


def _described(ctx: CarryContext, patch: CarriedPatch) -> tuple[Conflict, ...]:
    return describe(ctx.repo, ctx.tip, ctx.target.base_commit, patch.parsed)


def _conflicts_detail(version: str, conflicts: tuple[Conflict, ...]) -> str:
    where = ", ".join(f"{PurePosixPath(c.file).name}:{c.line}" for c in conflicts)
    count = f"{len(conflicts)} place{'s' if len(conflicts) != 1 else ''}"
    return f"the 3-way merge onto {version} conflicts in {count} ({where})"


def _reapplied(ctx: CarryContext) -> tuple[Reapplied | None, dict[str, str]]:
    """The intent re-applied to the work tree's files (nothing is written), and the
    functions upstream renamed since the previous release that it followed. Kept by
    content (intent/proofcache.py): the last strategy asks again, on the same files,
    for the reason it gives, and a dry run's answers serve the rebase after it."""
    if ctx.intent is None:
        return None, {}
    root = ctx.repo.root

    def read(path: str) -> str | None:
        file = root / path
        return file.read_text("utf-8") if file.is_file() else None

    files = [p for p in ctx.repo.files() if p.endswith(".py")]
    verdict = reapply_kept(ctx.intent, read, files)
    if verdict.status != "not-found":
        return verdict, {}
    # Its code is not where it was: perhaps upstream renamed a function it calls (two
    # `git grep`s, so only now).
    old, new = _lookup(ctx, ctx.previous), _lookup(ctx, ctx.target.base_commit)
    intent, renamed = renames.follow(ctx.intent, old, new)
    if not renamed:
        return verdict, {}
    followed = reapply_kept(intent, read, files)
    if followed.status not in ("upstreamed", "resolved"):
        return verdict, {}
    return replace(followed, detail=f"{followed.detail} ({renames.said(renamed)})"), renamed


def _lookup(ctx: CarryContext, commit: str) -> tuple[renames.Defining, renames.Reader]:
    """Where a release defines a function, and its files: what renames.follow compares."""
    return (
        lambda names: ctx.repo.defining(commit, names),
        lambda path: ctx.repo.read(commit, path),
    )
