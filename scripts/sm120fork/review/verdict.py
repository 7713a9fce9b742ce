"""The line a reviewer reads first: which SM12x behaviours change, and whether any
sm80-sm103 answer changes (a patch for SM12x should move none)."""

from __future__ import annotations

from sm120fork.gates.answer import NO, word
from sm120fork.gates.diff import GateChange
from sm120fork.gates.model import SM12X, Gate
from sm120fork.review.behaviour import OTHER_ARCHS
from sm120fork.review.model import BehaviourReview, CheckReview, GateScan, Row, Verdict


def _cells(row: Row, archs: tuple[str, ...]) -> str:
    return ", ".join(f"{a} = {row.cell(a)}" for a in archs if row.cell(a) is not None)


def _row(row: Row) -> str:
    return f"`{row.scenario}` {row.field}"


def _gate(gate: Gate) -> str:
    return f"gate `{gate.where}` {gate.function}: `{gate.condition}`"


def _answers(change: GateChange, archs: tuple[str, ...]) -> str:
    return "; ".join(
        f"{a}: {word(old)} -> {word(new)}" for a, (old, new) in change.archs.items() if a in archs
    )


def _changed_rows(behaviour: BehaviourReview, archs: tuple[str, ...]) -> list[str]:
    found = []
    for change in behaviour.changed:
        shown = tuple(a for a in change.archs if a in archs)
        if shown:
            moved = "; ".join(f"{a}: {change.old.cell(a)} -> {change.new.cell(a)}" for a in shown)
            found.append(f"row {_row(change.new)} ({moved})")
    return found


def _changed_gates(gates: GateScan, archs: tuple[str, ...]) -> list[str]:
    return [
        f"{_gate(change.new)} ({_answers(change, archs)})"
        for change in (*gates.diff.changed, *gates.diff.moved)
        if any(a in change.archs for a in archs)
    ]


def _sm12x(behaviour: BehaviourReview, gates: GateScan) -> list[str]:
    found = _changed_rows(behaviour, SM12X)
    found += [f"new row {_row(r)} ({_cells(r, SM12X)})" for r in behaviour.added]
    found += [f"row removed: {_row(r)} (was {_cells(r, SM12X)})" for r in behaviour.removed]
    found += _changed_gates(gates, SM12X)
    for label, listed in (("new", gates.diff.new), ("removed", gates.diff.removed)):
        for gate in listed:
            answers = [gate.archs.get(a) for a in SM12X]
            if any(answer != NO for answer in answers):
                shown = "; ".join(f"{a}: {word(gate.archs.get(a))}" for a in SM12X)
                found.append(f"{label} {_gate(gate)} ({shown})")
    return found


def _others(behaviour: BehaviourReview, gates: GateScan) -> list[str]:
    return _changed_rows(behaviour, OTHER_ARCHS) + _changed_gates(gates, OTHER_ARCHS)


def _count(n: int, what: str) -> str:
    return f"{n} {what}{'s' if n != 1 else ''}"


def decide(behaviour: BehaviourReview, gates: GateScan, checks: CheckReview) -> Verdict:
    sm12x, others = _sm12x(behaviour, gates), _others(behaviour, gates)
    first = f"SM12x: {_count(len(sm12x), 'behaviour change')}" if sm12x else "SM12x: no change"
    second = (
        f"sm80-sm103: {_count(len(others), 'change')} (there should be none)"
        if others
        else "sm80-sm103: no change"
    )
    third = (
        "series check: clean"
        if checks.clean
        else f"series check: {_count(len(checks.findings), 'finding')}"
    )
    return Verdict(f"{first}; {second}; {third}.", tuple(sm12x), tuple(others))
