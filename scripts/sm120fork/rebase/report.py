"""build/rebase/report.json and report.md (a PR description); see docs/contract.md.

`build` (and `up_to_date`, `refused`) make a `Report` record; `Report.to_json`
and `markdown` render it. `summary_line` reads a stored report.json (the
review quotes one).
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from sm120fork.fsutil import atomic_write_many
from sm120fork.gates.diff import GateDiff
from sm120fork.rebase import fate, gatefindings
from sm120fork.rebase.conflicts import gate_conditions
from sm120fork.rebase.gatefindings import KINDS
from sm120fork.rebase.ledger import shown
from sm120fork.rebase.state import Conflict, RebaseState, Status, StepResult

# How a `rebase VERSION` ended; the upstream watch reads this, not the exit code.
Result = Literal["complete", "conflict", "dry-run", "up-to-date", "bad-input"]
Source = Literal["pypi", "git"]
JsonObject = dict[str, object]
_DRY_RUN_NOTE = [
    "A dry run goes on past a conflict: the patches after one were carried without it.",
    "",
]


@dataclass(frozen=True)
class Walked:
    """With --step: a patch's release by release results."""

    first_break: str | None  # the release where it first needed more than an offset
    steps: tuple[StepResult, ...]


@dataclass(frozen=True)
class PatchEntry:
    """One patch as the report shows it (patches after a conflict are pending)."""

    name: str
    status: Status
    detail: str
    conflicts: tuple[Conflict, ...] = ()  # a conflicted or resolved patch's
    walked: Walked | None = None  # with --step


@dataclass(frozen=True)
class Release:
    """One release of a --step walk: each patch's result there, and the gates against
    the release before it."""

    version: str
    results: tuple[tuple[str, StepResult], ...]  # (patch, its result at this release)
    gates: GateDiff


@dataclass(frozen=True)
class Report:
    from_version: str | None
    to: str
    source: Source
    result: Result
    patches: tuple[PatchEntry, ...] = ()
    gates: GateDiff = field(default_factory=GateDiff.empty)
    releases: tuple[str, ...] | None = None  # with --step: the releases walked
    walk: tuple[Release, ...] | None = None  # with --step, once the gates are compared
    work_tree: str | None = None  # stopped on a conflict: where a person resolves it
    error: str | None = None  # bad input: the one line the command printed

    def to_json(self) -> JsonObject:
        """report.json, keys in the order docs/contract.md shows them."""
        data: JsonObject = {
            "from": self.from_version,
            "to": self.to,
            "source": self.source,
            "result": self.result,
            "patches": [_patch_json(p) for p in self.patches],
            "gates": self.gates.to_json(),
        }
        if self.releases is not None:
            data["releases"] = list(self.releases)
        if self.walk is not None:
            data["walk"] = [_release_json(release) for release in self.walk]
        if self.work_tree is not None:
            data["work_tree"] = self.work_tree
        if self.error is not None:
            data["error"] = self.error
        return data

    def summary_line(self) -> str:
        """`From sglang 0.5.9 to 0.5.23 (pypi): **complete**; 7 merged, 1 resolved.`"""
        statuses = (p.status for p in self.patches)
        return _summary_line(self.from_version, self.to, self.source, self.result, statuses)


def build(state: RebaseState, result: Result, gates: GateDiff, work_tree: str | None) -> Report:
    walk = None
    if state.step_mode and state.release_gates is not None:
        walk = _walk(state, state.release_gates)
    return Report(
        from_version=state.from_version,
        to=state.final.version,
        source="git" if state.git_url else "pypi",
        result=result,
        patches=tuple(_patch(state, index) for index in range(len(state.patches))),
        gates=gates,
        releases=tuple(t.version for t in state.targets) if state.step_mode else None,
        walk=walk,
        work_tree=work_tree if result == "conflict" and work_tree else None,
    )


def up_to_date(version: str, git_url: str | None) -> Report:
    """The pinned release is the newest: nothing carried, nothing compared."""
    return Report(version, version, "git" if git_url else "pypi", "up-to-date")


def refused(pinned: str | None, spec: str, git_url: str | None, error: str) -> Report:
    """A rebase refused before it began, or stopped by bad input (exit 2): `to` is the
    release as asked for, `error` the one line the command printed."""
    return Report(pinned, spec, "git" if git_url else "pypi", "bad-input", error=error)


def _walk(state: RebaseState, release_gates: Mapping[str, GateDiff]) -> tuple[Release, ...]:
    """Release by release: what happened to each patch there, and how its gates differ
    from the release before it."""
    return tuple(
        Release(
            target.version,
            tuple(
                (patch.name, step)
                for patch in state.patches
                for step in patch.steps
                if step.version == target.version
            ),
            release_gates.get(target.version, GateDiff.empty()),
        )
        for target in state.targets
    )


def _patch(state: RebaseState, index: int) -> PatchEntry:
    patch = state.patches[index]
    status, detail = shown(state, index)
    conflicts = patch.conflicts if status in ("conflict", "resolved") else ()
    walked = None
    if state.step_mode:
        found = fate.first_break(patch.steps)
        if status == "conflict" and found is None:
            found = (state.target.version, "")
        walked = Walked(found[0] if found else None, patch.steps)
    return PatchEntry(patch.name, status, detail, conflicts, walked)


def _step_json(step: StepResult) -> JsonObject:
    return {
        "status": step.status,
        "by_hand": step.by_hand,
        "detail": fate.step_detail(step),
        "note": step.note,
    }


def _release_json(release: Release) -> JsonObject:
    """The counts of the gates, and the gates whose SM12x answer changed."""
    return {
        "version": release.version,
        "patches": [
            {"name": name, **_step_json(step), "fate": fate.at_release(step)}
            for name, step in release.results
        ],
        "gates": {kind: len(release.gates.of_kind(kind)) for kind in KINDS},
        "gates_summary": gatefindings.summary(release.gates),
        "sm12x_changed": gatefindings.sm12x_changes(release.gates),
    }


@dataclass(frozen=True)
class _Conditions:
    """A gate conflict's conditions side by side."""

    old_upstream: list[str]
    new_upstream: list[str]
    patch: list[str]  # what the patch wanted


def _conditions(conflict: Conflict) -> _Conditions | None:
    if not conflict.gate:
        return None
    return _Conditions(
        gate_conditions(conflict.base),
        gate_conditions(conflict.ours),
        gate_conditions(conflict.theirs),
    )


def _conflict_json(conflict: Conflict) -> JsonObject:
    """file, line, gate, ours, theirs, base; for a gate also the conditions side by side:
    the old upstream's, the new upstream's, and what the patch wanted."""
    entry: JsonObject = dict(dataclasses.asdict(conflict))
    conditions = _conditions(conflict)
    if conditions is not None:
        entry["conditions"] = dataclasses.asdict(conditions)
    return entry


def _patch_json(patch: PatchEntry) -> JsonObject:
    entry: JsonObject = {
        "name": patch.name,
        "status": patch.status,
        "detail": patch.detail,
        "conflicts": [_conflict_json(c) for c in patch.conflicts],
    }
    if patch.walked is not None:
        entry["first_break"] = patch.walked.first_break
        entry["steps"] = [{"version": s.version, **_step_json(s)} for s in patch.walked.steps]
    return entry


def write(directory: Path, report: Report) -> tuple[Path, Path]:
    json_path, md_path = directory / "report.json", directory / "report.md"
    atomic_write_many(
        {
            json_path: (json.dumps(report.to_json(), indent=2) + "\n").encode("utf-8"),
            md_path: markdown(report).encode("utf-8"),
        }
    )
    return json_path, md_path


# GitHub refuses a pull-request body over 65536 characters; the upstream watch uses
# report.md as one, so the gate lists are shortened until it fits (report.json has all).
BODY_LIMIT = 65_000


def markdown(report: Report) -> str:
    """report.md: whole gate lists if they fit in a pull-request body, else shortened."""
    for listed in (None, 200, 50, 10, 0):
        text = _markdown(report, listed)
        if len(text) <= BODY_LIMIT:
            return text
    return text


def summary_line(report: Mapping[str, Any]) -> str:
    """The summary line of a stored report.json (see `Report.summary_line`)."""
    statuses = (p["status"] for p in report["patches"])
    return _summary_line(report["from"], report["to"], report["source"], report["result"], statuses)


def _summary_line(
    pinned: str | None, to: str, source: str, result: str, statuses: Iterable[str]
) -> str:
    counts = Counter(statuses)
    tally = ", ".join(f"{n} {status}" for status, n in counts.items()) or "no patches"
    outcome = {
        "complete": "complete",
        "conflict": "stopped on a conflict",
        "dry-run": "dry run, nothing written",
    }.get(result, result)
    return f"From sglang {pinned} to {to} ({source}): **{outcome}**; {tally}."


def _markdown(report: Report, listed: int | None) -> str:
    if report.result == "up-to-date":
        return (
            f"# The sm120 series is up to date\n\nsglang {report.to} ({report.source}) "
            "is the newest release: nothing to rebase.\n"
        )
    if report.result == "bad-input":
        return (
            f"# Rebase the sm120 series onto sglang {report.to}\n\n"
            f"**Refused** (bad input), from sglang {report.from_version}: {report.error}\n"
        )
    stops = any(p.status == "conflict" for p in report.patches)
    lines = [
        f"# Rebase the sm120 series onto sglang {report.to}",
        "",
        report.summary_line(),
        "",
        *(_DRY_RUN_NOTE if report.result == "dry-run" and stops else []),
        "| patch | status | what happened |",
        "|---|---|---|",
        *(f"| `{p.name}` | {p.status} | {_cell(p.detail)} |" for p in report.patches),
    ]
    lines += _walk_markdown(report.walk)
    lines += _conflicts_markdown(report)
    lines += ["", "## Gates", ""]
    if report.result == "conflict":
        return "\n".join([*lines, "Compared when the rebase completes.", ""])
    gates = report.gates
    lines += [gatefindings.summary(gates).capitalize() + ".", ""]
    for line in gatefindings.sm12x_changes(gates):
        lines.append(f"- SM12x answer changed: {line}")
    for kind in KINDS:
        found = gates.of_kind(kind)
        if found:
            listing = found if listed is None else found[:listed]
            lines += ["", f"<details><summary>{kind} ({len(found)})</summary>", ""]
            lines += [f"- {gatefindings.describe_gate(gate)}" for gate in listing]
            if len(listing) < len(found):
                lines.append(f"- ... and {len(found) - len(listing)} more in report.json")
            lines += ["", "</details>"]
    return "\n".join(lines).rstrip("\n") + "\n"


def _conflicts_markdown(report: Report) -> list[str]:
    conflicted = [p for p in report.patches if p.conflicts]
    if not conflicted:
        return []
    lines = ["", "## Conflicts", ""]
    if report.work_tree:
        lines += [
            f"The work tree with conflict markers is `{report.work_tree}`: edit the "
            "files there, then run `nox -s rebase -- --continue` (or `--abort`).",
            "",
        ]
    for patch in conflicted:
        how = " (resolved by its intent)" if patch.status == "resolved" else ""
        for c in patch.conflicts:
            gate = " (architecture gate)" if c.gate else ""
            title = f"`{patch.name}`{how}: `{c.file}` line {c.line}{gate}"
            lines += [f"### {title}", ""]
            lines += _conditions_table(_conditions(c))
            lines += ["Upstream (ours):", "", *_fenced(c.ours), ""]
            lines += ["The patch (theirs):", "", *_fenced(c.theirs), ""]
            if c.base:
                lines += ["Before both, in the old upstream:", "", *_fenced(c.base), ""]
    return lines


def _walk_markdown(walk: tuple[Release, ...] | None) -> list[str]:
    """Release by release: each patch's fate there, and the gate changes."""
    if not walk:
        return []
    lines = ["", "## Release by release", ""]
    for release in walk:
        lines += [f"### sglang {release.version}", ""]
        lines += [f"- `{name}`: {_cell(fate.at_release(s))}" for name, s in release.results]
        lines += [f"- Gates: {gatefindings.summary(release.gates)}."]
        changed = gatefindings.sm12x_changes(release.gates)
        lines += [f"- SM12x answer changed: {line}" for line in changed]
        lines.append("")
    return lines


def _conditions_table(conditions: _Conditions | None) -> list[str]:
    if conditions is None:
        return []
    sides = (conditions.old_upstream, conditions.new_upstream, conditions.patch)
    if not any(sides):
        return []
    rows = max(len(side) for side in sides)

    def cell(values: list[str], i: int) -> str:
        return f"`{_cell(values[i])}`" if i < len(values) else ""

    lines = ["| old upstream | new upstream | the patch wanted |", "|---|---|---|"]
    lines += [f"| {' | '.join(cell(side, i) for side in sides)} |" for i in range(rows)]
    return [*lines, ""]


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _fenced(text: str) -> list[str]:
    longest = max((len(run) for run in re.findall(r"`+", text)), default=0)
    fence = "`" * max(3, longest + 1)
    return [f"{fence}python", *text.rstrip("\n").split("\n"), fence]
