"""review.md's Gates, Behaviour and Checks sections."""

from __future__ import annotations

from sm120fork.gates.answer import word
from sm120fork.gates.diff import GateChange
from sm120fork.gates.model import SM12X, UNREVIEWED, Gate
from sm120fork.markdown import cell, code
from sm120fork.review.behaviour import ARCH_NAMES
from sm120fork.review.mdtext import bullets, details, plural
from sm120fork.review.model import (
    BehaviourReview,
    CheckReview,
    Decision,
    DecisionChange,
    Review,
    Row,
    RowChange,
)


def _decision(decision: Decision | None) -> str:
    if decision is None:
        return "-"
    patch = f" ({code(decision.patch)})" if decision.patch else ""
    return f"{decision.decision}{patch}"


def _decision_line(change: DecisionChange) -> str:
    where = cell(change.where, 240)
    if change.kind == "changed" and change.old and change.new:
        text = f"{where}: {_decision(change.old)} -> {_decision(change.new)}"
        if change.old.reason != change.new.reason:
            text += f"; reason was: {cell(change.old.reason)}; now: {cell(change.new.reason)}"
        else:
            text += f" ({cell(change.new.reason)})"
        return text
    shown = change.new or change.old
    assert shown is not None
    return f"{change.kind}: {where}: {_decision(shown)} ({cell(shown.reason)})"


def _answers(gate: Gate) -> str:
    answers = ", ".join(f"{a} {word(gate.archs.get(a))}" for a in SM12X)
    return answers if gate.decision == UNREVIEWED else f"{answers}; {gate.decision}"


def _gate(gate: Gate) -> str:
    return (
        f"{code(gate.where)} {cell(gate.function, 80)}: {code(cell(gate.condition, 140))} "
        f"({_answers(gate)})"
    )


def _change(change: GateChange) -> str:
    old, new = change.old, change.new
    if (old.file, old.function) != (new.file, new.function):
        text = f"{_gate(old)} -> {_gate(new)}"
    else:
        text = (
            f"{code(new.where)} {cell(new.function, 80)}: {code(cell(old.condition, 140))} "
            f"-> {code(cell(new.condition, 140))} ({_answers(new)})"
        )
    return text + (f": {change.note}" if change.note else "")


def gates_section(review: Review, limit: int | None) -> list[str]:
    lines = ["### Gates", ""]
    changes = review.decisions
    if changes:
        count = plural(len(changes), "decision")
        lines += [f"`patches/gates.toml`: {count} added, removed or changed:", ""]
        lines += [*bullets([_decision_line(c) for c in changes], limit), ""]
    else:
        lines += ["`patches/gates.toml`: no decision changed.", ""]
    scan = review.gates
    if scan.scope == "limited":
        scope = (
            f"Scanned the {plural(len(scan.files), 'file')} either series touches (vendor/ "
            "unchanged, so no other file differs; a flag these files export is not followed "
            "into the files importing it: `--full-scan` scans everything)"
        )
    else:
        scope = "Scanned both patched trees in full"
    diff = scan.diff
    counts = ", ".join(
        f"{len(getattr(diff, k))} {k}" for k in ("new", "removed", "changed", "moved")
    )
    lines += [f"{scope}: {scan.base_gates} -> {scan.head_gates} gates; {counts}.", ""]
    for kind in ("changed", "moved"):
        found = getattr(diff, kind)
        if found:
            items = [_change(c) for c in found]
            lines += details(f"{kind} ({len(found)})", bullets(items, limit), open_=True)
    for kind in ("new", "removed"):
        found = getattr(diff, kind)
        if found:
            lines += details(f"{kind} ({len(found)})", bullets([_gate(g) for g in found], limit))
    return lines


_HEADER = "| scenario | field | " + " | ".join(ARCH_NAMES) + " | patch |"
_DIVIDER = "|---|---|" + "---|" * len(ARCH_NAMES) + "---|"


def _row(row: Row, changed: RowChange | None = None) -> str:
    cells = []
    for arch in ARCH_NAMES:
        value = cell(row.cell(arch) or "-", 60)
        if changed is not None and arch in changed.archs:
            value = f"**{cell(changed.old.cell(arch) or '-', 60)} → {value}**"
        cells.append(value)
    patch = code(row.patch) if row.patch else ""
    if changed is not None and changed.old.patch != row.patch:
        patch = f"{code(changed.old.patch) if changed.old.patch else '-'} → {patch or '-'}"
    return (
        f"| {code(row.scenario)} | {cell(row.field, 80)} | " + " | ".join(cells) + f" | {patch} |"
    )


def _table(title: str, rows: list[str], limit: int | None) -> list[str]:
    shown = rows if limit is None else rows[: max(limit, 1)]
    more = (
        [f"... and {len(rows) - len(shown)} more in review.json", ""]
        if len(shown) < len(rows)
        else []
    )
    return [f"{title} ({len(rows)}):", "", _HEADER, _DIVIDER, *shown, "", *more]


def behaviour_section(behaviour: BehaviourReview, limit: int | None) -> list[str]:
    lines = ["### Behaviour", ""]
    parts = (
        (
            "Changed rows of `gatetable/expectations.toml`",
            [_row(c.new, c) for c in behaviour.changed],
        ),
        ("Added rows", [_row(r) for r in behaviour.added]),
        ("Removed rows", [_row(r) for r in behaviour.removed]),
        ("Rows whose patch is not in the series", [_row(r) for r in behaviour.orphaned]),
    )
    if not any(rows for _, rows in parts):
        return [*lines, "No row of `gatetable/expectations.toml` changed.", ""]
    for title, rows in parts:
        if rows:
            lines += _table(title, rows, limit)
    return lines


def checks_section(checks: CheckReview, limit: int | None) -> list[str]:
    lines = ["### Checks", ""]
    if checks.clean:
        return [*lines, "`check` at HEAD: the series is clean.", ""]
    lines += [f"`check` at HEAD: {plural(len(checks.findings), 'finding')}:", ""]
    return [*lines, *bullets([code(f) for f in checks.findings], limit), ""]
