"""build/rebase/report.json and report.md (a PR description); see docs/contract.md.

`build` (and `up_to_date`, `refused`) make a `Report` record; `Report.to_json`
renders the JSON, `report_md` the Markdown and the writing of both files.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Literal

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
    strategy: str = ""  # what carried or dropped it at the last release reached


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
    last = patch.steps[-1] if patch.steps and status != "pending" else None
    return PatchEntry(patch.name, status, detail, conflicts, walked, last.strategy if last else "")


def _step_json(step: StepResult) -> JsonObject:
    return {
        "status": step.status,
        "by_hand": step.by_hand,
        "strategy": step.strategy,
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
        "strategy": patch.strategy,
        "detail": patch.detail,
        "conflicts": [_conflict_json(c) for c in patch.conflicts],
    }
    if patch.walked is not None:
        entry["first_break"] = patch.walked.first_break
        entry["steps"] = [{"version": s.version, **_step_json(s)} for s in patch.walked.steps]
    return entry


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
