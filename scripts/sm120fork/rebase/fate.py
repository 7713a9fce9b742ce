"""Every sentence about a patch's fate, in the report, the CHANGELOG and the progress lines.

The carry records a fate as data: a status, the tool's reason (why, without
any fate wording), and for a hand resolution the person's note. This module
alone turns that into words:

- `detail`: a step's one sentence (the report's `detail`);
- `first_break`: the headline naming the release where a patch first needed
  more than an offset (`--step`);
- `at_release` and `overall`: the CHANGELOG's sentences for one release and
  for the whole rebase;
- `strategy`, `not_reached`, `gone`: the progress line, a pending patch,
  the patches an earlier release already dropped.
"""

from __future__ import annotations

from collections.abc import Iterable

from sm120fork.rebase.state import PatchState, Status, StepResult

BY_HAND = "by hand"  # the strategy of a step a person resolved or dropped
HAND = "conflict resolved by hand"  # the reason of a hand resolution that changes something
TO_NOTHING = "the conflict was resolved by hand to no change"  # one that changes nothing
_LEAVES: tuple[Status, ...] = ("upstreamed", "dropped")
_CARRIED = {
    "clean": "carried unchanged",
    "offset": "refreshed (it applied at shifted lines)",
    "merged": "merged with upstream's changes by a 3-way merge; refreshed",
    "resolved": "re-applied from its intent (patches/intents.toml); refreshed",
}
_STRATEGY = {
    "clean": "applies unchanged",
    "offset": "at shifted lines, refreshed",
    "merged": "3-way merge by git, refreshed",
    "resolved": "re-applied by its intent",
    "upstreamed": "upstream has it, dropped",
    "dropped": "dropped by hand",
    "conflict": "needs a person",
}


def leaves_series(status: Status) -> bool:
    """Whether a patch with this status leaves the series (upstreamed, or dropped by hand)."""
    return status in _LEAVES


def detail(status: Status, reason: str, version: str) -> str:
    """The one sentence a result at release `version` is recorded with."""
    if status == "upstreamed":
        return f"{reason}; dropped"
    if status == "dropped":
        return f"dropped by hand at {version}: {reason.rstrip('.')}"
    return reason


def step_detail(step: StepResult) -> str:
    """A step's one sentence (the report's `steps[].detail`)."""
    return detail(step.status, step.reason, step.version)


def _by_hand_drop(step: StepResult) -> bool:
    """Dropped by a person: `--drop`, or a conflict resolved to no change."""
    return step.status == "dropped" or (step.by_hand and step.status == "upstreamed")


def first_break(steps: Iterable[StepResult]) -> tuple[str, str] | None:
    """(release, what happened) where the patch first needed more than an offset."""
    for step in steps:
        if _by_hand_drop(step):
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


def summed(steps: tuple[StepResult, ...], step_mode: bool) -> str:
    """A patch's detail: its last result, after the headline with --step."""
    found = first_break(steps)
    last = step_detail(steps[-1]) if steps else ""
    return f"{found[1]}; {last}" if step_mode and found else last


def at_release(step: StepResult) -> str:
    """What happened to a patch at one release, one sentence (CHANGELOG, report `walk`)."""
    said = step.note.rstrip(".") if step.note else "no reason given"
    if _by_hand_drop(step):
        fate = f"conflicted; dropped by hand: {said}"
    elif step.by_hand:
        fate = f"conflicted; rewritten by hand (the tool could not: {said}); refreshed"
    elif step.status == "upstreamed":
        fate = f"dropped as upstreamed: {step.reason}"
    else:
        fate = _CARRIED.get(step.status, step.status)
    return fate.rstrip(".") + ("" if step.by_hand else _by(step)) + "."


def overall(patch: PatchState, step_mode: bool) -> str:
    """What happened to a patch over the whole rebase, one sentence (CHANGELOG)."""
    hand = [step for step in patch.steps if step.by_hand]
    last = patch.steps[-1] if patch.steps else None
    found = first_break(patch.steps) if step_mode else None
    if leaves_series(patch.status) and last is not None and _by_hand_drop(last):
        fate = f"dropped by hand at {last.version}: {last.note or 'no reason given'}"
    elif patch.status == "upstreamed" and last is not None:
        why = f"{found[1]}; {last.reason}" if found else last.reason
        fate = f"dropped as upstreamed: {why}"
    elif hand:
        fate = "merged; conflict resolved by hand; refreshed"
        notes = [f"{step.version}: {step.note.rstrip('.')}" for step in hand if step.note]
        if notes:
            fate += f" (why by hand: {'; '.join(notes)})"
    else:
        fate = _CARRIED.get(patch.status, patch.status)
    if found and not leaves_series(patch.status):
        fate += f" ({found[1]})"
    by = _by(last) if last is not None and not last.by_hand else ""
    return fate.rstrip(".") + by + "."


def strategy(status: Status, name: str = "") -> str:
    """How the tool carried a patch, a few words for the progress line (`name`: the
    strategy that did)."""
    said = _STRATEGY.get(status, status)
    return f"{said}; strategy {name}" if name and name != "none" else said


def _by(step: StepResult) -> str:
    """` [strategy: x]`, the strategy a step was carried or dropped by ("" if none)."""
    return f" [strategy: {step.strategy}]" if step.strategy and step.strategy != "none" else ""


def not_reached(blocker: str | None) -> str:
    """The detail of a pending patch (`blocker`: the patch the rebase stopped at)."""
    if blocker is None:
        return "not reached"
    return f"not reached: the rebase stopped at the conflict in {blocker}"


def gone(names: list[str]) -> str:
    """The CHANGELOG line for the patches an earlier release of a --step walk dropped."""
    listed = ", ".join(f"`{name}`" for name in names)
    return f"No longer in the series (dropped at an earlier release): {listed}."
