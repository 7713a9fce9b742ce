"""build/rebase/report.json and report.md (a PR description); see docs/contract.md."""

from __future__ import annotations

import dataclasses
import json
import re
from collections import Counter
from pathlib import Path
from typing import Any, Literal

from sm120fork.fsutil import atomic_write_many
from sm120fork.rebase import fate, gatefindings
from sm120fork.rebase.conflicts import gate_conditions
from sm120fork.rebase.gatefindings import KINDS
from sm120fork.rebase.ledger import shown
from sm120fork.rebase.state import Conflict, RebaseState, StepResult

# How a `rebase VERSION` ended; the upstream watch reads this, not the exit code.
Result = Literal["complete", "conflict", "dry-run", "up-to-date", "bad-input"]
_DRY_RUN_NOTE = [
    "A dry run goes on past a conflict: the patches after one were carried without it.",
    "",
]


def build(
    state: RebaseState, result: Result, gates: dict[str, list[Any]], work_tree: str | None
) -> dict[str, Any]:
    report: dict[str, Any] = {
        "from": state.from_version,
        "to": state.final.version,
        "source": "git" if state.git_url else "pypi",
        "result": result,
        "patches": [_patch(state, index) for index in range(len(state.patches))],
        "gates": {kind: gates.get(kind, []) for kind in KINDS},
    }
    if state.step_mode:
        report["releases"] = [target.version for target in state.targets]
        if state.release_gates is not None:
            report["walk"] = _walk(state)
    if result == "conflict" and work_tree:
        report["work_tree"] = work_tree
    return report


def up_to_date(version: str, git_url: str | None) -> dict[str, Any]:
    """The pinned release is the newest: nothing carried, nothing compared."""
    return _outcome(version, version, git_url, "up-to-date")


def refused(pinned: str | None, spec: str, git_url: str | None, error: str) -> dict[str, Any]:
    """A rebase refused before it began, or stopped by bad input (exit 2): `to` is the
    release as asked for, `error` the one line the command printed."""
    return {**_outcome(pinned, spec, git_url, "bad-input"), "error": error}


def _outcome(pinned: str | None, to: str, git_url: str | None, result: Result) -> dict[str, Any]:
    return {
        "from": pinned,
        "to": to,
        "source": "git" if git_url else "pypi",
        "result": result,
        "patches": [],
        "gates": {kind: [] for kind in KINDS},
    }


def _walk(state: RebaseState) -> list[dict[str, Any]]:
    """Release by release: what happened to each patch there, and how its gates differ
    from the release before it (counts, and the gates whose SM12x answer changed)."""
    assert state.release_gates is not None
    walk = []
    for target in state.targets:
        gates = state.release_gates.get(target.version, {})
        patches = [
            {"name": patch.name, **_step_json(step), "fate": fate.at_release(step)}
            for patch in state.patches
            for step in patch.steps
            if step.version == target.version
        ]
        walk.append(
            {
                "version": target.version,
                "patches": patches,
                "gates": {kind: len(gates.get(kind, [])) for kind in KINDS},
                "gates_summary": gatefindings.summary(gates),
                "sm12x_changed": gatefindings.sm12x_changes(gates),
            }
        )
    return walk


def _step_json(step: StepResult) -> dict[str, Any]:
    return {
        "status": step.status,
        "by_hand": step.by_hand,
        "detail": fate.step_detail(step),
        "note": step.note,
    }


def _conflict(conflict: Conflict) -> dict[str, Any]:
    """file, line, gate, ours, theirs, base; for a gate also the conditions side by side:
    the old upstream's, the new upstream's, and what the patch wanted."""
    entry = dataclasses.asdict(conflict)
    if conflict.gate:
        entry["conditions"] = {
            "old_upstream": gate_conditions(conflict.base),
            "new_upstream": gate_conditions(conflict.ours),
            "patch": gate_conditions(conflict.theirs),
        }
    return entry


def _patch(state: RebaseState, index: int) -> dict[str, Any]:
    patch = state.patches[index]
    status, detail = shown(state, index)
    entry: dict[str, Any] = {
        "name": patch.name,
        "status": status,
        "detail": detail,
        "conflicts": [
            _conflict(c) for c in (patch.conflicts if status in ("conflict", "resolved") else ())
        ],
    }
    if state.step_mode:
        found = fate.first_break(patch.steps)
        if status == "conflict" and found is None:
            found = (state.target.version, "")
        entry["first_break"] = found[0] if found else None
        entry["steps"] = [{"version": s.version, **_step_json(s)} for s in patch.steps]
    return entry


def write(directory: Path, report: dict[str, Any]) -> tuple[Path, Path]:
    json_path, md_path = directory / "report.json", directory / "report.md"
    atomic_write_many(
        {
            json_path: (json.dumps(report, indent=2) + "\n").encode("utf-8"),
            md_path: markdown(report).encode("utf-8"),
        }
    )
    return json_path, md_path


# GitHub refuses a pull-request body over 65536 characters; the upstream watch uses
# report.md as one, so the gate lists are shortened until it fits (report.json has all).
BODY_LIMIT = 65_000


def markdown(report: dict[str, Any]) -> str:
    """report.md: whole gate lists if they fit in a pull-request body, else shortened."""
    for listed in (None, 200, 50, 10, 0):
        text = _markdown(report, listed)
        if len(text) <= BODY_LIMIT:
            return text
    return text


def summary_line(report: dict[str, Any]) -> str:
    """`From sglang 0.5.9 to 0.5.23 (pypi): **complete**; 7 merged, 1 resolved.`"""
    counts = Counter(p["status"] for p in report["patches"])
    tally = ", ".join(f"{n} {status}" for status, n in counts.items()) or "no patches"
    outcome = {
        "complete": "complete",
        "conflict": "stopped on a conflict",
        "dry-run": "dry run, nothing written",
    }.get(report["result"], report["result"])
    return (
        f"From sglang {report['from']} to {report['to']} ({report['source']}): "
        f"**{outcome}**; {tally}."
    )


def _markdown(report: dict[str, Any], listed: int | None) -> str:
    if report["result"] == "up-to-date":
        return (
            f"# The sm120 series is up to date\n\nsglang {report['to']} ({report['source']}) "
            "is the newest release: nothing to rebase.\n"
        )
    if report["result"] == "bad-input":
        return (
            f"# Rebase the sm120 series onto sglang {report['to']}\n\n"
            f"**Refused** (bad input), from sglang {report['from']}: {report['error']}\n"
        )
    counts = Counter(p["status"] for p in report["patches"])
    lines = [
        f"# Rebase the sm120 series onto sglang {report['to']}",
        "",
        summary_line(report),
        "",
        *(_DRY_RUN_NOTE if report["result"] == "dry-run" and counts["conflict"] else []),
        "| patch | status | what happened |",
        "|---|---|---|",
        *(f"| `{p['name']}` | {p['status']} | {_cell(p['detail'])} |" for p in report["patches"]),
    ]
    lines += _walk_markdown(report.get("walk"))
    conflicted = [p for p in report["patches"] if p["conflicts"]]
    if conflicted:
        lines += ["", "## Conflicts", ""]
        if report.get("work_tree"):
            lines += [
                f"The work tree with conflict markers is `{report['work_tree']}`: edit the "
                "files there, then run `nox -s rebase -- --continue` (or `--abort`).",
                "",
            ]
        for patch in conflicted:
            fate = " (resolved by its intent)" if patch["status"] == "resolved" else ""
            for c in patch["conflicts"]:
                gate = " (architecture gate)" if c["gate"] else ""
                title = f"`{patch['name']}`{fate}: `{c['file']}` line {c['line']}{gate}"
                lines += [f"### {title}", ""]
                lines += _conditions_table(c.get("conditions"))
                lines += ["Upstream (ours):", "", *_fenced(c["ours"]), ""]
                lines += ["The patch (theirs):", "", *_fenced(c["theirs"]), ""]
                if c.get("base"):
                    lines += ["Before both, in the old upstream:", "", *_fenced(c["base"]), ""]
    lines += ["", "## Gates", ""]
    if report["result"] == "conflict":
        return "\n".join([*lines, "Compared when the rebase completes.", ""])
    gates = report["gates"]
    lines += [gatefindings.summary(gates).capitalize() + ".", ""]
    for line in gatefindings.sm12x_changes(gates):
        lines.append(f"- SM12x answer changed: {line}")
    for kind in KINDS:
        found = gates.get(kind, [])
        if found:
            shown = found if listed is None else found[:listed]
            lines += ["", f"<details><summary>{kind} ({len(found)})</summary>", ""]
            lines += [f"- {gatefindings.describe_gate(gate)}" for gate in shown]
            if len(shown) < len(found):
                lines.append(f"- ... and {len(found) - len(shown)} more in report.json")
            lines += ["", "</details>"]
    return "\n".join(lines).rstrip("\n") + "\n"


def _walk_markdown(walk: list[dict[str, Any]] | None) -> list[str]:
    """Release by release: each patch's fate there, and the gate changes."""
    if not walk:
        return []
    lines = ["", "## Release by release", ""]
    for release in walk:
        lines += [f"### sglang {release['version']}", ""]
        lines += [f"- `{p['name']}`: {_cell(p['fate'])}" for p in release["patches"]]
        lines += [f"- Gates: {release['gates_summary']}."]
        lines += [f"- SM12x answer changed: {line}" for line in release["sm12x_changed"]]
        lines.append("")
    return lines


def _conditions_table(conditions: dict[str, list[str]] | None) -> list[str]:
    if not conditions or not any(conditions.values()):
        return []
    rows = max(len(v) for v in conditions.values())

    def cell(side: str, i: int) -> str:
        values = conditions[side]
        return f"`{_cell(values[i])}`" if i < len(values) else ""

    lines = ["| old upstream | new upstream | the patch wanted |", "|---|---|---|"]
    lines += [
        f"| {cell('old_upstream', i)} | {cell('new_upstream', i)} | {cell('patch', i)} |"
        for i in range(rows)
    ]
    return [*lines, ""]


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _fenced(text: str) -> list[str]:
    longest = max((len(run) for run in re.findall(r"`+", text)), default=0)
    fence = "`" * max(3, longest + 1)
    return [f"{fence}python", *text.rstrip("\n").split("\n"), fence]
