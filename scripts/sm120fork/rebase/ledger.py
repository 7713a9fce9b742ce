"""Each patch's fate: one result per release carried to, summed up in status and detail.

With --step a patch is carried release by release; its status is the most
serious of its results (clean < offset < merged < upstreamed), and its
detail starts by naming the first release where it needed a merge,
conflicted or went upstream.
"""

from __future__ import annotations

from dataclasses import replace

from sm120fork.rebase.carry import Outcome
from sm120fork.rebase.state import RebaseState, Status, StepResult

_RANK: dict[Status, int] = {
    "pending": -1,
    "clean": 0,
    "offset": 1,
    "merged": 2,
    "resolved": 2,
    "upstreamed": 3,
    "conflict": 4,
}
HAND = "conflict resolved by hand"


def first_break(steps: tuple[StepResult, ...]) -> tuple[str, str] | None:
    """(release, what happened) where the patch first needed more than an offset."""
    for step in steps:
        if step.by_hand and step.status == "upstreamed":
            return step.version, f"conflicted at {step.version} and was dropped by hand"
        if step.by_hand:
            return step.version, f"first conflicted at {step.version} (resolved by hand)"
        if step.status == "merged":
            return step.version, f"first needed a 3-way merge at {step.version}"
        if step.status == "resolved":
            return step.version, f"first re-applied by intent at {step.version}"
        if step.status == "upstreamed":
            return step.version, f"went upstream at {step.version}"
        if step.status == "conflict":
            return step.version, f"first conflicted at {step.version}"
    return None


def record(state: RebaseState, index: int, outcome: Outcome, note: str = "") -> RebaseState:
    """`state` with patch `index`'s result at the current release recorded (`note`: what
    the person who resolved a conflict said about it)."""
    patch = state.patches[index]
    version = state.target.version
    if outcome.status == "conflict":
        found = first_break(patch.steps)
        headline = found[1] if found else f"first conflicted at {version}"
        detail = f"{headline}; {outcome.detail}" if state.step_mode else outcome.detail
        # The conflict is a step too: --step names the release where it happened.
        steps = (*patch.steps, StepResult(version, "conflict", False, outcome.detail))
        return state.with_patch(
            index,
            replace(
                patch, status="conflict", detail=detail, conflicts=outcome.conflicts, steps=steps
            ),
        )
    earlier = patch.steps
    if earlier and earlier[-1].status == "conflict" and earlier[-1].version == version:
        earlier = earlier[:-1]  # resolved by hand: this result replaces the conflict
    by_hand = patch.status == "conflict"
    steps = (*earlier, StepResult(version, outcome.status, by_hand, outcome.detail, note))
    found = first_break(steps)
    carried = replace(
        patch,
        status=max((s.status for s in steps), key=_RANK.__getitem__),
        detail=f"{found[1]}; {outcome.detail}" if state.step_mode and found else outcome.detail,
        steps=steps,
        conflicts=outcome.conflicts,  # a resolved patch keeps what it resolved
        commit=outcome.commit or patch.commit,
        text=outcome.text or patch.text,
    )
    return state.with_patch(index, carried)


def shown(state: RebaseState, index: int) -> tuple[Status, str]:
    """Status and detail as the report shows them (patches after a conflict are pending)."""
    patch = state.patches[index]
    stopped = state.phase == "conflict"
    if stopped and index > state.patch_index and patch.status != "upstreamed":
        blocker = state.patches[state.patch_index].name
        return "pending", f"not reached: the rebase stopped at the conflict in {blocker}"
    if patch.status == "pending":
        return "pending", "not reached"
    return patch.status, patch.detail
