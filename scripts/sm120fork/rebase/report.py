"""build/rebase/report.json and report.md (a PR description); see docs/contract.md.

`build` (and `up_to_date`, `refused`) make a `Report` record; `Report.to_json`
renders the JSON (`Report.from_json` reads it back), `report_md` the Markdown
and the writing of both files.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Literal, get_args

from sm120fork import jsondata
from sm120fork.gates.diff import GateDiff
from sm120fork.rebase import fate, gatefindings
from sm120fork.rebase.conflicts import gate_conditions
from sm120fork.rebase.gatefindings import KINDS
from sm120fork.rebase.ledger import shown
from sm120fork.rebase.state import Conflict, RebaseState, Status, StepResult
from sm120fork.upstream.source import UpstreamSource

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
    verified: str = ""  # what its rows showed on the last release reached (verify.py)


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
    # Landed: the intents that no longer reproduce their patch, (patch, why): `check`
    # names them until a person re-derives them (rebase/landintents.py).
    stale_intents: tuple[tuple[str, str], ...] = ()

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
        if self.stale_intents:
            data["stale_intents"] = [{"patch": n, "why": w} for n, w in self.stale_intents]
        return data

    @staticmethod
    def from_json(data: jsondata.JsonObject) -> Report:
        """Read back `to_json()` as far as it is stored whole: the --step walk (its gates
        are kept as counts) and each patch's steps are left out."""
        releases = data.get("releases")
        return Report(
            from_version=jsondata.optional_text(data, "from"),
            to=jsondata.text(data, "to"),
            source=_SOURCES[jsondata.text(data, "source")],
            result=_RESULTS[jsondata.text(data, "result")],
            patches=tuple(
                _patch_from_json(jsondata.obj(p)) for p in jsondata.array(data["patches"])
            ),
            gates=GateDiff.from_json(jsondata.obj(data.get("gates", {}))),
            releases=None if releases is None else jsondata.texts(data, "releases"),
            work_tree=jsondata.optional_text(data, "work_tree"),
            error=jsondata.optional_text(data, "error"),
            stale_intents=tuple(
                (jsondata.text(jsondata.obj(s), "patch"), jsondata.text(jsondata.obj(s), "why"))
                for s in jsondata.array(data.get("stale_intents", []))
            ),
        )

    def summary_line(self) -> str:
        """`From sglang 0.5.9 to 0.5.23 (pypi): **complete**; 7 merged, 1 resolved.`"""
        counts = Counter(p.status for p in self.patches)
        tally = ", ".join(f"{n} {status}" for status, n in counts.items()) or "no patches"
        outcome = {
            "complete": "complete",
            "conflict": "stopped on a conflict",
            "dry-run": "dry run, nothing written",
        }.get(self.result, self.result)
        span = f"From sglang {self.from_version} to {self.to} ({self.source})"
        return f"{span}: **{outcome}**; {tally}."


# What report.json may hold for each Literal field, read back as that type.
_SOURCES: dict[str, Source] = {value: value for value in get_args(Source)}
_RESULTS: dict[str, Result] = {value: value for value in get_args(Result)}
_STATUSES: dict[str, Status] = {value: value for value in get_args(Status)}


def build(state: RebaseState, result: Result, gates: GateDiff, work_tree: str | None) -> Report:
    walk = None
    if state.step_mode and state.release_gates is not None:
        walk = _walk(state, state.release_gates)
    return Report(
        from_version=state.from_version,
        to=state.final.version,
        source=state.source.kind,
        result=result,
        patches=tuple(_patch(state, index) for index in range(len(state.patches))),
        gates=gates,
        releases=tuple(t.version for t in state.targets) if state.step_mode else None,
        walk=walk,
        work_tree=work_tree if result == "conflict" and work_tree else None,
    )


def up_to_date(version: str, source: UpstreamSource) -> Report:
    """The pinned release is the newest: nothing carried, nothing compared."""
    return Report(version, version, source.kind, "up-to-date")


def refused(pinned: str | None, spec: str, source: UpstreamSource, error: str) -> Report:
    """A rebase refused before it began, or stopped by bad input (exit 2): `to` is the
    release as asked for, `error` the one line the command printed."""
    return Report(pinned, spec, source.kind, "bad-input", error=error)


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
    strategy, verified = (last.strategy, last.verified) if last else ("", "")
    return PatchEntry(patch.name, status, detail, conflicts, walked, strategy, verified)


def _step_json(step: StepResult) -> JsonObject:
    return {
        "status": step.status,
        "by_hand": step.by_hand,
        "strategy": step.strategy,
        "detail": fate.step_detail(step),
        "note": step.note,
        "verified": step.verified,
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
        "verified": patch.verified,
        "conflicts": [_conflict_json(c) for c in patch.conflicts],
    }
    if patch.walked is not None:
        entry["first_break"] = patch.walked.first_break
        entry["steps"] = [{"version": s.version, **_step_json(s)} for s in patch.walked.steps]
    return entry


def _patch_from_json(data: jsondata.JsonObject) -> PatchEntry:
    conflicts = (jsondata.obj(c) for c in jsondata.array(data.get("conflicts", [])))
    return PatchEntry(
        name=jsondata.text(data, "name"),
        status=_STATUSES[jsondata.text(data, "status")],
        detail=jsondata.text(data, "detail", ""),
        conflicts=tuple(_conflict_from_json(c) for c in conflicts),
    )


def _conflict_from_json(data: jsondata.JsonObject) -> Conflict:
    return Conflict(
        file=jsondata.text(data, "file"),
        line=jsondata.integer(data, "line"),
        gate=jsondata.flag(data, "gate"),
        ours=jsondata.text(data, "ours"),
        theirs=jsondata.text(data, "theirs"),
        base=jsondata.text(data, "base", ""),
    )
