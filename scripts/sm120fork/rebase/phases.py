"""The phases before landing: fetch, prepare, carry, and finishing a resolved conflict.

Each phase saves the state before the next begins, so --continue picks up
after a crash wherever it happened (fetch is redone whole; carry resumes at
the next patch, after putting the work tree back to the recorded tip).
"""

from __future__ import annotations

from dataclasses import replace

from sm120fork.errors import EXIT_FINDINGS, FatalError
from sm120fork.intent import renames
from sm120fork.intent.model import Intent, load_intents
from sm120fork.patches.applier import ApplyError, Overlay, apply_patch
from sm120fork.patches.normalform import DiffRenderer
from sm120fork.patches.patchfile import PatchFile
from sm120fork.progress import Counter, Progress
from sm120fork.rebase import fate, ledger, targets, verify
from sm120fork.rebase.carry import carry
from sm120fork.rebase.conflicts import remaining_markers
from sm120fork.rebase.names import broken_lines
from sm120fork.rebase.state import RebaseState, crash_point
from sm120fork.rebase.strategy import CarryContext, Outcome, carried, finish, parsed
from sm120fork.rebase.workrepo import WorkRepo
from sm120fork.rebase.workspace import PREFIX, Workspace, say
from sm120fork.upstream import lock


def fetch(workspace: Workspace, state: RebaseState) -> RebaseState:
    """Download every target release not downloaded yet."""
    locked = lock.read(workspace.paths.lock_file)
    for index, target in enumerate(state.targets):
        if not target.lock_text:
            say(f"fetching sglang {target.version} from {state.source.name}")
            text = targets.fetch(
                target.version,
                source=state.source,
                workdir=workspace.release_dir(target.version),
                locked=locked,
                progress=say,
            )
            state = workspace.save(state.with_target(index, replace(target, lock_text=text)))
    state = workspace.save(replace(state, phase="prepare"))
    crash_point("after-fetch")
    return state


def prepare(workspace: Workspace, state: RebaseState) -> RebaseState:
    """The work repository: the pinned release, then one commit per patch, each patch
    applied in memory (the work tree is first checked out at the new release)."""
    say(f"committing sglang {state.from_version} and the series in a work repository")
    repo = WorkRepo.create(workspace.work)
    message = f"sglang {state.from_version}"
    base = repo.commit_dir(workspace.paths.upstream_tree, None, message)
    overlay = Overlay(workspace.paths.upstream_tree)
    series = []
    for patch in state.patches:
        changes = _applied(overlay, parsed(patch))
        if not changes:
            raise FatalError(f"{patch.name} no longer applies to vendor/sglang; run `check`")
        series.append((patch.name, changes))
    commits = repo.commit_series(base, series) if series else []
    patches = tuple(replace(p, commit=c) for p, c in zip(state.patches, commits, strict=True))
    state = workspace.save(replace(state, phase="carry", old_base=base, patches=patches))
    crash_point("after-prepare")
    return state


def _applied(overlay: Overlay, patch: PatchFile) -> dict[str, str | None]:
    """What `patch` changes, applied exactly to `overlay` (and kept there); {} when it
    does not apply or changes nothing."""
    before = {path: overlay.read(path) for path in patch.paths}
    try:
        apply_patch(overlay, patch, allow_offset=False)
    except ApplyError:
        return {}
    after = {path: overlay.read(path) for path in before}
    return {path: text for path, text in after.items() if text != before[path]}


def carry_all(workspace: Workspace, state: RebaseState) -> RebaseState:
    """Carry the series onto each target in turn; stop at a conflict (not in a dry run)."""
    repo = WorkRepo(workspace.work)
    with DiffRenderer() as renderer, Progress(PREFIX) as shown:
        releases = shown.add("releases", len(state.targets), state.release_index)
        patches = shown.add("patches", len(state.patches), state.patch_index)
        while state.release_index < len(state.targets):
            shown.update(releases, name=f"release sglang {state.target.version}")
            state = _carry_release(workspace, repo, renderer, state, (shown, patches))
            if state.phase == "conflict":
                return state
            shown.update(releases, completed=state.release_index)
    return workspace.save(replace(state, phase="finalize"))


def _carry_release(
    workspace: Workspace,
    repo: WorkRepo,
    renderer: DiffRenderer,
    state: RebaseState,
    display: tuple[Progress, Counter],
) -> RebaseState:
    shown, patches = display
    index = state.release_index
    if not state.tip:
        target = state.target
        parent = state.targets[index - 1].base_commit if index else state.old_base
        base = repo.commit_dir(workspace.tree(target.version), parent, f"sglang {target.version}")
        state = state.with_target(index, replace(target, base_commit=base))
        state = workspace.save(replace(state, tip=base, patch_index=0))
        state = verify.drop_upstreamed(workspace, repo, state)
        state = workspace.save(verify.start_release(state))
    repo.checkout(state.tip)  # also whatever a crash left in the work tree
    releases = len(state.targets)
    where = (
        f"release {index + 1}/{releases} sglang {state.target.version}: " if releases > 1 else ""
    )
    intents = load_intents(workspace.paths.intents_file)
    total = len(state.patches)
    shown.update(patches, completed=state.patch_index)
    for number in range(state.patch_index, total):
        patch = state.patches[number]
        if fate.leaves_series(patch.status) or patch.status == "conflict":
            shown.update(patches, completed=number + 1)
            continue  # dropped at an earlier release, or a dry run went past its conflict
        shown.update(patches, name=f"patch {patch.name}")
        ctx = CarryContext(
            repo=repo,
            tip=state.tip,
            target=state.target,
            renderer=renderer,
            intent=followed(intents.get(patch.name), patch.renames),
            fork_root=workspace.paths.root,
            previous=patch.commit,
        )
        outcome = carry(ctx, carried(patch))
        crash_point("mid-carry")
        state = ledger.record(state, number, outcome)
        how = fate.strategy(outcome.status, outcome.strategy)
        shown.line(
            f"{where}carrying patch {number + 1}/{total} {patch.name}: {outcome.status} ({how})"
        )
        shown.update(patches, completed=number + 1)
        if outcome.status == "conflict" and workspace.dry_run:
            repo.checkout(state.tip)  # predict the later patches without this one
        elif outcome.status == "conflict":
            return workspace.save(replace(state, phase="conflict", patch_index=number))
        state = workspace.save(
            replace(state, patch_index=number + 1, tip=outcome.commit or state.tip)
        )
        crash_point(f"after-patch-{number + 1}")
    previous = state.targets[index - 1].base_commit if index else state.old_base
    state = workspace.save(verify.verify_release(workspace, repo, state, previous))
    if state.phase == "conflict":
        return state
    return workspace.save(replace(state, release_index=index + 1, patch_index=0, tip=""))


def followed(intent: Intent | None, renamed: tuple[tuple[str, str], ...]) -> Intent | None:
    """The patch's intent calling the functions it followed at earlier releases by their
    new names (landing writes them into patches/intents.toml)."""
    return None if intent is None else renames.applied(intent, dict(renamed))


def resolved(
    workspace: Workspace, state: RebaseState, *, note: str = "", drop: str = ""
) -> RebaseState:
    """Finish the conflicted patch with the person's edits of the work tree, or drop it
    (`drop`: why upstream no longer needs it). `note` says why the tool could not."""
    if not (workspace.work / ".git").is_dir():
        raise FatalError(
            f"the work tree {workspace.work} is gone; run `rebase --abort` and start again"
        )
    repo = WorkRepo(workspace.work)
    if repo.out("rev-parse", "HEAD") != state.tip:  # a crash after committing the resolution
        repo.git("reset", "-q", "--soft", state.tip)
    patch = state.patches[state.patch_index]
    version = state.target.version
    if drop:
        repo.checkout(state.tip)  # the person's edits, if any, go with the patch
        outcome = Outcome("dropped", drop, strategy=fate.BY_HAND)
    else:
        outcome = _finish_by_hand(workspace, repo, state)
    crash_point("resolved")
    state = ledger.record(state, state.patch_index, outcome, note or drop)
    said = fate.detail(outcome.status, outcome.reason, version)
    say(f"{patch.name}: {outcome.status} ({said})")
    tip = outcome.commit or state.tip
    return workspace.save(replace(state, phase="carry", patch_index=state.patch_index + 1, tip=tip))


def _finish_by_hand(workspace: Workspace, repo: WorkRepo, state: RebaseState) -> Outcome:
    patch = state.patches[state.patch_index]
    edited = sorted({c.file for c in patch.conflicts} | set(repo.dirty_paths()))
    left = remaining_markers(repo, edited)
    if left:
        more = f" and {len(left) - 3} more" if len(left) > 3 else ""
        raise FatalError(
            f"conflict markers remain at {', '.join(left[:3])}{more} in {workspace.work}; "
            "edit them out, then run `rebase --continue`",
            EXIT_FINDINGS,
        )
    with DiffRenderer() as renderer:
        ctx = CarryContext(
            repo, state.tip, state.target, renderer, None, workspace.paths.root, patch.commit
        )
        outcome = finish(ctx, parsed(patch), "merged", fate.HAND, fate.BY_HAND)
    broken = broken_lines(repo, state.tip, outcome.commit, patch.commit) if outcome.commit else []
    if broken:
        repo.git("reset", "-q", "--mixed", state.tip)  # the edits stay for another try
        raise FatalError(
            f"the resolution breaks: {'; '.join(b.describe() for b in broken)} in "
            f"{workspace.work}; fix it, then run `rebase --continue`",
            EXIT_FINDINGS,
        )
    if outcome.status == "upstreamed":
        outcome = replace(outcome, reason=fate.TO_NOTHING)
    return outcome
