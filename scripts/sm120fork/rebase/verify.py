"""Verification, part of the carry: a patch's fate at a release is final only once its
own gate-table rows ran there (verdicts.py says what they show).

At each release, before the carry (`drop_upstreamed`): the pristine release is
observed for the rows of every patch still in the series, and a patch whose SM12x
cells upstream already gives is `upstreamed`, its rows the evidence. After the
carry (`verify_release`): the patched release is observed beside the pristine one,
and each patch carried there is verified in series order; the first that is not
stops the rebase at that patch, whatever strategy carried it. The patches after it
go back to where the release began (the state keeps that snapshot), and the
stopped patch's carried change is left in the work tree for a person, uncommitted
on the patches before it, as for a conflict: `--continue` takes it as edited,
`--drop` drops it, and the release is verified again once carried (a refusal
stopped for review that the person continued is theirs: it does not stop again;
failing rows still do).

The rows run in the release's decision environment (decisionenv.py); where none
can be had, the rebase stops at the first patch with rows and says why, never a
pass. Every verdict names the environment that decided.
"""

from __future__ import annotations

from dataclasses import replace

from sm120fork import gateenv
from sm120fork.errors import FatalError
from sm120fork.harness import table
from sm120fork.rebase import decisionenv, fate, gaterows, ledger, verdicts
from sm120fork.rebase.state import PatchState, RebaseState
from sm120fork.rebase.strategy import Outcome, parsed
from sm120fork.rebase.workrepo import WorkRepo
from sm120fork.rebase.workspace import Workspace, say

NAME = "rows"  # the strategy of a patch its rows found upstreamed


def _live(state: RebaseState) -> list[int]:
    return [
        i
        for i, p in enumerate(state.patches)
        if not fate.leaves_series(p.status) and p.status != "conflict"
    ]


def _observer(
    workspace: Workspace, repo: WorkRepo, version: str
) -> tuple[gaterows.Observer | None, str]:
    """The observer of the release's rows, or None and why not."""
    try:
        env = decisionenv.find(workspace.paths.root, version, workspace.release_dir(version), say)
    except FatalError as error:
        return None, error.message
    kept = workspace.paths.rebase_dir.with_name("rebase-observed")  # outlives a rebase
    return gaterows.Observer(repo, env, workspace.paths.root, kept), env.why


def drop_upstreamed(workspace: Workspace, repo: WorkRepo, state: RebaseState) -> RebaseState:
    """`state` with each patch whose rows pass on the pristine release upstreamed."""
    found = gaterows.load(workspace.paths.root)
    live = [i for i in _live(state) if found and found.of(state.patches[i].name)]
    if found is None or not live:
        return state
    version = state.target.version
    observer, why = _observer(workspace, repo, version)
    if observer is None:
        return state  # verify_release stops on it, once the carry is done
    scenarios = sorted({r.scenario for i in live for r in found.of(state.patches[i].name)})
    say(f"running the rows of {len(live)} patches on pristine sglang {version} in {why}")
    try:
        pristine = observer.observe([state.target.base_commit], scenarios, found.archs)
    except FatalError as error:
        say(f"the rows could not run on pristine sglang {version}: {error.message}")
        return state
    base = pristine[state.target.base_commit]
    for index in live:
        patch = state.patches[index]
        added = verdicts.added_text(parsed(patch))
        verdict = verdicts.upstreamed(version, found.of(patch.name), base, found.sm12x, added)
        if verdict.ok:
            say(f"{patch.name}: upstreamed ({verdict.reason})")
            outcome = Outcome("upstreamed", f"{verdict.reason}; decided in {why}", strategy=NAME)
            state = ledger.record(state, index, outcome)
    return state


def verify_release(
    workspace: Workspace, repo: WorkRepo, state: RebaseState, previous: str
) -> RebaseState:
    """After the release's carry: each carried patch verified, or the rebase stopped at
    the first that is not (`previous`: the pristine commit of the release before)."""
    version = state.target.version
    found = gaterows.load(workspace.paths.root)
    carried = [
        i
        for i in _live(state)
        if state.patches[i].steps[-1:] and state.patches[i].steps[-1].version == version
    ]
    if found is None or not carried:
        return state
    with_rows = [i for i in carried if found.of(state.patches[i].name)]
    for index in carried:
        if index not in with_rows:  # the table lists why, or `check` refuses the series
            why = found.untested.get(state.patches[index].name, "no gate-table row names it")
            state = _verified(state, index, f"not verified: untested by rows ({why})")
    if not with_rows:
        return state
    observer, why = _observer(workspace, repo, version)
    if observer is None:
        return _stop(repo, state, with_rows[0], f"its rows could not run: {why}")
    rows = {i: found.of(state.patches[i].name) for i in with_rows}
    scenarios = sorted({r.scenario for each in rows.values() for r in each})
    refusals = sorted({r.scenario for each in rows.values() for r in each if _refuses(r, found)})
    say(f"verifying {len(with_rows)} patches on patched sglang {version} in {why}")
    try:
        seen = observer.observe([state.target.base_commit, state.tip], scenarios, found.archs)
        earlier = _previous_observer(workspace, repo, state) if refusals else None
        before = earlier.observe([previous], refusals, found.sm12x)[previous] if earlier else None
    except FatalError as error:
        reason = f"its rows could not run in {why}: {error.message}"
        return _stop(repo, state, with_rows[0], reason)
    others = [a for a in found.archs if a not in found.sm12x]
    observed = (seen[state.target.base_commit], seen[state.tip], before)
    for index in with_rows:
        verdict = verdicts.after_carry(version, rows[index], observed, found.sm12x, others)
        said = f"{verdict.reason}; decided in {why}"
        reviewed = state.patches[index].steps[-1].strategy == fate.BY_HAND
        if verdict.kind == "review" and reviewed:  # a person kept the refusal: settled
            state = _verified(state, index, f"verified by a person (`--continue`): {said}")
        elif verdict.ok:
            state = _verified(state, index, said)
        elif workspace.dry_run:  # predict the others as carried
            state = ledger.record(state, index, _stopped(state.patches[index], said))
        else:
            return _stop(repo, state, index, said)
    return state


def _previous_observer(
    workspace: Workspace, repo: WorkRepo, state: RebaseState
) -> gaterows.Observer | None:
    """The observer of the release before, in that release's own environment (its
    pristine rows are kept from its own verification): the pinned release's is the
    fork's gate environment. None where it has none: no refusal is then reviewed."""
    index = state.release_index
    if index:
        return _observer(workspace, repo, state.targets[index - 1].version)[0]
    own = gateenv.locate(workspace.paths.root)
    if not own.python.exists():
        return None
    env = decisionenv.DecisionEnv(own.python, f"{own.venv} (the fork's gate environment)")
    kept = workspace.paths.rebase_dir.with_name("rebase-observed")
    return gaterows.Observer(repo, env, workspace.paths.root, kept)


def _refuses(row: table.Row, found: gaterows.Table) -> bool:
    return any(str(row.cells.get(a, "")).startswith(table.RAISES) for a in found.sm12x)


def _verified(state: RebaseState, index: int, said: str) -> RebaseState:
    patch = state.patches[index]
    last = replace(patch.steps[-1], verified=said)
    return state.with_patch(index, replace(patch, steps=(*patch.steps[:-1], last)))


def _stopped(patch: PatchState, reason: str) -> Outcome:
    last = patch.steps[-1]
    said = f"carried ({last.status}, by {last.strategy}), then stopped: {reason}"
    return Outcome("conflict", said, strategy="none")


def _stop(repo: WorkRepo, state: RebaseState, index: int, reason: str) -> RebaseState:
    """The rebase stopped at patch `index`: the patches after it back to the release's
    start, its carried change left uncommitted in the work tree on the ones before."""
    patch = state.patches[index]
    parent = repo.out("rev-parse", f"{patch.commit}^")
    repo.checkout(patch.commit)
    repo.git("reset", "-q", "--mixed", parent)
    outcome = _stopped(patch, reason)
    start = state.release_start
    restored = (
        *state.patches[:index],
        replace(patch, commit=start[index].commit),
        *start[index + 1 :],
    )
    state = ledger.record(replace(state, patches=restored), index, outcome)
    return replace(state, phase="conflict", patch_index=index, tip=parent)


def start_release(state: RebaseState) -> RebaseState:
    """Keep the patches as the release's carry finds them (for `_stop`)."""
    return replace(state, release_start=state.patches)
