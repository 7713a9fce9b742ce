"""Each patch's fate: one result per release carried to, summed up in status and detail.

With --step a patch is carried release by release; its status is the most
serious of its results (clean < offset < merged < upstreamed, dropped <
conflict), and its detail starts by naming the first release where it needed
a merge, conflicted or went upstream. The words are fate.py's.
"""

from __future__ import annotations

from dataclasses import replace

from sm120fork.rebase import fate
from sm120fork.rebase.state import RebaseState, Status, StepResult
from sm120fork.rebase.strategy import Outcome

_RANK: dict[Status, int] = {
    "pending": -1,
    "clean": 0,
    "offset": 1,
    "merged": 2,
    "resolved": 2,
    "upstreamed": 3,
    "dropped": 3,
    "conflict": 4,
}


def record(state: RebaseState, index: int, outcome: Outcome, note: str = "") -> RebaseState:
    """`state` with patch `index`'s result at the current release recorded (`note`: what
    the person who resolved a conflict said about it)."""
    patch = state.patches[index]
    version = state.target.version
    if outcome.status == "conflict":
        # The conflict is a step too: --step names the release where it happened (it
        # replaces a carry at that release that verification then refused).
        earlier = tuple(s for s in patch.steps if s.version != version)
        steps = (*earlier, StepResult(version, "conflict", False, outcome.reason))
        return state.with_patch(
            index,
            replace(
                patch,
                status="conflict",
                detail=fate.summed(steps, state.step_mode),
                conflicts=outcome.conflicts,
                steps=steps,
            ),
        )
    earlier = patch.steps
    if earlier and earlier[-1].status == "conflict" and earlier[-1].version == version:
        earlier = earlier[:-1]  # resolved by hand: this result replaces the conflict
    by_hand = patch.status == "conflict"
    strategy = fate.BY_HAND if by_hand else outcome.strategy
    step = StepResult(version, outcome.status, by_hand, outcome.reason, note, strategy)
    steps = (*earlier, step)
    carried = replace(
        patch,
        status=max((s.status for s in steps), key=_RANK.__getitem__),
        detail=fate.summed(steps, state.step_mode),
        steps=steps,
        conflicts=outcome.conflicts,  # a resolved patch keeps what it resolved
        commit=outcome.commit or patch.commit,
        text=outcome.text or patch.text,
        renames=(*patch.renames, *outcome.renames),
    )
    return state.with_patch(index, carried)


def shown(state: RebaseState, index: int) -> tuple[Status, str]:
    """Status and detail as the report shows them (patches after a conflict are pending)."""
    patch = state.patches[index]
    stopped = state.phase == "conflict"
    if stopped and index > state.patch_index and not fate.leaves_series(patch.status):
        return "pending", fate.not_reached(state.patches[state.patch_index].name)
    if patch.status == "pending":
        return "pending", fate.not_reached(None)
    return patch.status, patch.detail
