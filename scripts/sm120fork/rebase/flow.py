"""The rebase from start to landing, and --continue / --abort.

Phases, each persisted before the next begins (state.py), so --continue
picks up after a crash wherever it happened:

    fetch     download every target release            phases.fetch
    prepare   the work repository: old base + patches  phases.prepare
    carry     each patch onto each target in turn      phases.carry_all
    conflict  stopped: a person edits the work tree, then --continue (phases.resolved)
    finalize  stage, swap (journal), clean up, report  landing.land
"""

from __future__ import annotations

import contextlib
import shutil
import tempfile
from pathlib import Path

from sm120fork.errors import EXIT_FINDINGS, EXIT_OK, FatalError
from sm120fork.gates import warm
from sm120fork.gates.diff import GateDiff
from sm120fork.patches.stack import load_stack
from sm120fork.paths import RepoPaths
from sm120fork.rebase import landing, phases, preconditions, report, report_md, targets
from sm120fork.rebase.state import MemoryStore, RebaseState, StateDir, Target
from sm120fork.rebase.strategy import state_of
from sm120fork.rebase.workspace import Workspace, say
from sm120fork.upstream import UpstreamSource, lock


def start(paths: RepoPaths, spec: str, *, source: UpstreamSource, step: bool, dry_run: bool) -> int:
    """`rebase VERSION`: whatever the outcome, build/rebase/report.json says it in
    `result` (nox turns every failure into exit 1, so scripts read that instead)."""
    state_dir = StateDir.of(paths.root)
    with state_dir.running():
        preconditions.refuse_in_progress(state_dir)  # and keep that rebase's report
        try:
            return _start(paths, state_dir, spec, source=source, step=step, dry_run=dry_run)
        except FatalError as error:
            refused = report.refused(_pinned_version(paths), spec, source, error.message)
            with contextlib.suppress(OSError):  # the error itself is what the person must see
                report_md.write(paths.rebase_dir, refused)
            raise


def _start(
    paths: RepoPaths,
    state_dir: StateDir,
    spec: str,
    *,
    source: UpstreamSource,
    step: bool,
    dry_run: bool,
) -> int:
    pinned = preconditions.check_start(paths, dry_run=dry_run)
    stack = load_stack(paths)
    with tempfile.TemporaryDirectory(prefix="sm120fork-rebase-") as scratch:
        versions = targets.plan(
            spec, pinned.version, source=source, step=step, scratch=Path(scratch)
        )
        if not versions:
            return _up_to_date(paths, pinned.version, source)
        state = RebaseState(
            from_version=pinned.version,
            git_url=source.git_url,
            step_mode=step,
            phase="fetch",
            fingerprint=preconditions.fingerprint(paths),
            targets=tuple(Target(version) for version in versions),
            patches=tuple(state_of(p) for p in stack.patches),
        )
        if dry_run:
            return _drive(Workspace(paths, Path(scratch), MemoryStore(), dry_run=True), state)
    area = paths.rebase_dir
    shutil.rmtree(area, ignore_errors=True)
    state_dir.create(state)
    return _drive(Workspace(paths, area, state_dir), state)


def _up_to_date(paths: RepoPaths, version: str, source: UpstreamSource) -> int:
    """Nothing newer than the pinned release: success, in one line (the upstream watch
    runs `rebase latest` every day)."""
    _, md = report_md.write(paths.rebase_dir, report.up_to_date(version, source))
    print(f"up to date with sglang {version}: no newer release {source.where}; report {md}")
    return EXIT_OK


def _pinned_version(paths: RepoPaths) -> str | None:
    try:
        pinned = lock.read(paths.lock_file)
    except FatalError:
        return None
    return pinned.version if pinned else None


def resume(paths: RepoPaths, *, note: str = "", drop: str = "") -> int:
    """--continue (`note`: why the tool could not carry the patch) or --drop REASON."""
    state_dir = StateDir.of(paths.root)
    with state_dir.running():
        state = state_dir.load()
        workspace = Workspace(paths, paths.rebase_dir, state_dir)
        if (note or drop) and state.phase != "conflict":
            option = "--drop" if drop else "--note"
            raise FatalError(
                f"{option} speaks of a conflicted patch, and none is waiting; "
                "run `rebase --continue` alone"
            )
        if state.phase != "finalize":
            preconditions.check_resume(paths, state.fingerprint)
        if state.phase == "conflict":
            state = phases.resolved(workspace, state, note=note, drop=drop)
        return _drive(workspace, state)


def abort(paths: RepoPaths) -> int:
    state_dir = StateDir.of(paths.root)
    with state_dir.running():
        if not state_dir.exists():
            raise FatalError("no rebase in progress; nothing to abort")
        try:
            state = state_dir.load()
        except FatalError as error:  # a missing or damaged state must not block --abort
            say(f"warning: {error.message.rsplit('; ', 1)[0]}")
            state = None
        workspace = Workspace(paths, paths.rebase_dir, state_dir)
        if state is not None and state.journal is not None:
            if state.journal.step == "swapped":
                landing.land(workspace, state)
                raise FatalError(
                    "the rebase had already landed when it stopped, so it is now complete; "
                    "undo it with git (`git checkout -- vendor patches CHANGELOG.md`)"
                )
            landing.undo(paths.root, state.journal)
        shutil.rmtree(workspace.area, ignore_errors=True)
        state_dir.remove()
    if state is None:
        say(
            "aborted without a readable state: vendor/, patches/ and CHANGELOG.md were left "
            "as they are; `git status` shows whether the rebase had changed them"
        )
    else:
        say("aborted: vendor/, patches/ and CHANGELOG.md are as they were before the rebase")
    return EXIT_OK


def _drive(workspace: Workspace, state: RebaseState) -> int:
    if state.phase == "fetch":
        state = phases.fetch(workspace, state)
    if state.gates is None:  # scan both ends while the patches are carried (gates/warm.py)
        ends = [workspace.paths.upstream_tree, *(workspace.tree(t.version) for t in state.targets)]
        warm.start(ends)
    try:
        if state.phase == "prepare":
            state = phases.prepare(workspace, state)
        if state.phase == "carry":
            state = phases.carry_all(workspace, state)
        if state.phase == "conflict":
            return _stopped(workspace, state)
        if workspace.dry_run:
            return _predicted(workspace, state)
        return landing.land(workspace, state)
    finally:
        warm.stop()  # stopped before the comparison (a conflict, an error): no scan needed


def _predicted(workspace: Workspace, state: RebaseState) -> int:
    """The end of a dry run: the report, and exit 1 if a patch would stop the rebase."""
    state = workspace.release_gates(state)
    _, md = report_md.write(
        workspace.reports, report.build(state, "dry-run", workspace.gates(state), None)
    )
    stoppers = [patch for patch in state.patches if patch.status == "conflict"]
    for patch in stoppers:
        for conflict in patch.conflicts:
            say(f"{patch.name} would conflict at {conflict.file}:{conflict.line}")
    outcome = f"{len(stoppers)} patches would conflict" if stoppers else "no patch conflicts"
    if state.phase == "conflict":  # stopped where the rebase would: its rows cannot run
        patch = state.patches[state.patch_index]
        say(f"{patch.name}: {patch.steps[-1].reason}")
        outcome = f"stopped at {patch.name} (sglang {state.target.version}); the rest not carried"
    print(f"dry run onto sglang {state.final.version}: {outcome}; report {md}")
    return EXIT_FINDINGS if stoppers else EXIT_OK


def _stopped(workspace: Workspace, state: RebaseState) -> int:
    if workspace.dry_run:  # its work tree is a scratch directory, gone when it ends
        return _predicted(workspace, state)
    patch = state.patches[state.patch_index]
    work = workspace.work.relative_to(workspace.paths.root)
    built = report.build(state, "conflict", GateDiff.empty(), str(work))
    _, md = report_md.write(workspace.reports, built)
    for conflict in patch.conflicts:
        say(f"conflict: {conflict.file}:{conflict.line} (line of sglang {state.target.version})")
    if not patch.conflicts:  # stopped by its rows: its carried change is in the work tree
        say(f"{patch.name}: {patch.steps[-1].reason}")
    edit = "edit the conflict markers" if patch.conflicts else "fix its change"
    say(
        f"stopped at {patch.name}: {edit} in {work}, then run `rebase --continue` "
        f"(`--drop REASON` if upstream no longer needs it, or `--abort`); report {md}"
    )
    return EXIT_FINDINGS
