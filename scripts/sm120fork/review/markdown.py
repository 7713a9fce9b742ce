"""review.md: the review as a pull-request comment, verdict first; its Gates,
Behaviour and Checks sections.

Rendered from the `Review` record. Interdiffs and gate lists are shortened
step by step until the comment fits GitHub's limit; review.json has them all.
"""

from __future__ import annotations

from sm120fork.gates.answer import word
from sm120fork.gates.diff import GateChange
from sm120fork.gates.model import SM12X, UNREVIEWED, Gate
from sm120fork.markdown import cell, code
from sm120fork.review.behaviour import ARCH_NAMES
from sm120fork.review.mdtext import BODY_LIMIT, bullets, details, fenced, plural
from sm120fork.review.model import (
    EFFECTS,
    BehaviourReview,
    CheckReview,
    Decision,
    DecisionChange,
    PatchReview,
    Review,
    RevInfo,
    Row,
    RowChange,
    SeriesReview,
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


MARKER = "<!-- sm120fork-review -->"  # the workflow finds its own comment by this line
_LIMITS = (None, 1000, 400, 200, 100, 50, 25, 12, 6, 3, 0)  # lines or items per list


def render(review: Review) -> str:
    for limit in _LIMITS:
        text = _render(review, limit)
        if len(text) <= BODY_LIMIT:
            return text
    return text


def _side(info: RevInfo) -> str:
    version = f", sglang {info.version}" if info.version else ""
    return f"{code(info.ref)} ({info.commit[:12]}{version})"


def _render(review: Review, limit: int | None) -> str:
    verdict = review.verdict
    lines = [
        MARKER,
        f"## Review of `patches/`: {review.base.ref} -> {review.head.ref}",
        "",
        f"**{verdict.line}**",
        "",
        f"BASE {_side(review.base)}, HEAD {_side(review.head)}.",
        "",
    ]
    if verdict.sm12x:
        lines += ["SM12x behaviour that changes:", "", *bullets(verdict.sm12x, limit), ""]
    if verdict.other_archs:
        lines += ["sm80-sm103 answers that change:", "", *bullets(verdict.other_archs, limit), ""]
    lines += series_section(review.series, limit)
    if review.upstream is not None:
        lines += base_section(review)
    lines += gates_section(review, limit)
    lines += behaviour_section(review.behaviour, limit)
    lines += checks_section(review.checks, limit)
    return "\n".join(lines).rstrip("\n") + "\n"


def series_section(series: SeriesReview, limit: int | None) -> list[str]:
    lines = ["### Series", ""]
    if not series.patches and not series.reordered:
        return [*lines, f"No patch changed ({len(series.head)} in the series).", ""]
    counts = (
        (len(series.with_status("added")), "added"),
        (len(series.with_status("removed")), "removed"),
        (len(series.with_status("renamed")), "renamed"),
        (len(series.reordered), "reordered"),
        (len(series.with_status("changed")), "changed"),
    )
    tally = ", ".join(f"{n} {what}" for n, what in counts if n)
    lines += [f"{len(series.base)} -> {len(series.head)} patches: {tally}.", ""]
    for move in series.reordered:
        lines.append(
            f"- {code(move.name)} moved from place {move.old_position} to {move.new_position}"
        )
    for name, why in series.unusable:
        lines.append(f"- {code(name)} cannot be read at HEAD: {cell(why)}")
    if series.reordered or series.unusable:
        lines.append("")
    for patch in series.patches:
        lines += _patch(patch, limit)
    return lines


def _patch(patch: PatchReview, limit: int | None) -> list[str]:
    name = code(patch.name)
    if patch.old_name:
        name = f"{code(patch.old_name)} -> {name}"
    if patch.effect in ("same", "refresh", "header-only") and not patch.header:
        note = f" ({cell(patch.note)})" if patch.note else ""
        return [f"- {name}: {EFFECTS[patch.effect]}{note}.", ""]
    lines = [f"#### {name}: {EFFECTS[patch.effect]}", ""]
    if patch.subject:
        lines += [f"{cell(patch.subject)} ({', '.join(code(f) for f in patch.files)})", ""]
    for change in patch.header:
        if change.field == "Description":
            lines.append("- Description: reworded")
        else:
            lines.append(
                f"- {change.field}: {cell(change.old) or '-'} -> {cell(change.new) or '-'}"
            )
    if patch.note:
        lines.append(f"- {cell(patch.note, 400)}")
    if patch.header or patch.note:
        lines.append("")
    if patch.interdiff:
        block = fenced(patch.interdiff, "diff", limit)
        if patch.effect in ("added", "removed"):
            what = "the patch" if patch.effect == "added" else "what dropping it undoes"
            lines += details(f"{what}: {plural(patch.interdiff.count(chr(10)), 'line')}", block)
        else:
            lines += ["Interdiff of the patched file (BASE -> HEAD):", "", *block, ""]
    return lines


def base_section(review: Review) -> list[str]:
    upstream = review.upstream
    assert upstream is not None
    lines = [
        "### Base",
        "",
        f"`vendor/sglang.lock` changed: sglang {upstream.old or '-'} -> {upstream.new or '-'} "
        f"({cell(upstream.old_from) or '-'} -> {cell(upstream.new_from) or '-'}).",
        "",
    ]
    if upstream.report is None:
        return [*lines, "No rebase report names these two releases.", ""]
    lines += [f"Rebase report ({code(upstream.report)}):", ""]
    return [*lines, *bullets(upstream.summary, None), ""]
