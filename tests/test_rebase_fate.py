"""rebase/fate.py words a fate recorded as data: a status, the tool's reason, a note."""

from __future__ import annotations

from sm120fork.rebase import fate
from sm120fork.rebase.state import PatchState, StepResult


def test_each_status_gets_its_words_once() -> None:
    why = "upstream 0.5.10 already makes this change (the patch reverse-applies)"
    assert fate.detail("upstreamed", why, "0.5.10") == f"{why}; dropped"
    assert fate.detail("dropped", "upstream has it.", "0.5.10") == (
        "dropped by hand at 0.5.10: upstream has it"
    )
    assert fate.detail("merged", "git merged it", "0.5.10") == "git merged it"
    upstreamed = StepResult("0.5.10", "upstreamed", reason=why)
    assert fate.at_release(upstreamed) == f"dropped as upstreamed: {why}."


def test_a_drop_by_hand_is_dropped_and_leaves_the_series() -> None:
    step = StepResult("0.5.10", "dropped", by_hand=True, reason="gone", note="gone")
    patch = PatchState("a.patch", 1, status="dropped", steps=(step,))
    assert fate.leaves_series("dropped") and fate.leaves_series("upstreamed")
    assert not fate.leaves_series("conflict")
    assert fate.first_break((step,)) == ("0.5.10", "conflicted at 0.5.10 and was dropped by hand")
    assert fate.at_release(step) == "conflicted; dropped by hand: gone."
    assert fate.overall(patch, step_mode=True) == "dropped by hand at 0.5.10: gone."
    assert fate.summed((step,), step_mode=False) == "dropped by hand at 0.5.10: gone"
