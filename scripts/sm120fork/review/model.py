"""The review as one typed record; review.json and review.md are both rendered from it.

Every record is immutable and has `to_json()`; the Markdown renderer reads the
records, never the JSON.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from sm120fork.gates.diff import GateDiff

# What a change to one patch amounts to (PatchReview.effect).
EFFECTS = {
    "added": "new in the series",
    "removed": "dropped from the series",
    "same": "the same change",
    "header-only": "only its DEP-3 header changed",
    "refresh": "refresh only: the same change, at other lines",
    "changed": "changes what the patched file does",
    "unapplied": "does not apply on one side",
}


@dataclass(frozen=True)
class RevInfo:
    ref: str
    commit: str
    version: str | None  # the vendored sglang release (vendor/sglang.lock)

    def to_json(self) -> dict[str, Any]:
        return {"ref": self.ref, "commit": self.commit, "version": self.version}


@dataclass(frozen=True)
class FieldChange:
    field: str
    old: str | None
    new: str | None

    def to_json(self) -> dict[str, Any]:
        return {"field": self.field, "old": self.old, "new": self.new}


@dataclass(frozen=True)
class PatchReview:
    name: str
    status: str  # added | removed | changed | renamed
    effect: str  # a key of EFFECTS
    subject: str
    files: tuple[str, ...]
    old_name: str | None = None  # renamed from
    header: tuple[FieldChange, ...] = ()
    interdiff: str = ""  # the patched files, BASE -> HEAD (a git diff)
    note: str = ""

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "status": self.status,
            "old_name": self.old_name,
            "effect": self.effect,
            "subject": self.subject,
            "files": list(self.files),
            "header": [c.to_json() for c in self.header],
            "interdiff": self.interdiff,
            "note": self.note,
        }


@dataclass(frozen=True)
class Move:
    name: str
    old_position: int  # 1-based place in the series
    new_position: int

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "old_position": self.old_position,
            "new_position": self.new_position,
        }


@dataclass(frozen=True)
class SeriesReview:
    base: tuple[str, ...]
    head: tuple[str, ...]
    patches: tuple[PatchReview, ...]  # every patch that is not byte-for-byte the same
    reordered: tuple[Move, ...]
    unusable: tuple[tuple[str, str], ...] = ()  # HEAD's patches that cannot be read

    def with_status(self, *statuses: str) -> tuple[PatchReview, ...]:
        return tuple(p for p in self.patches if p.status in statuses)

    def to_json(self) -> dict[str, Any]:
        return {
            "base": list(self.base),
            "head": list(self.head),
            "added": [p.name for p in self.with_status("added")],
            "removed": [p.name for p in self.with_status("removed")],
            "renamed": [{"old": p.old_name, "new": p.name} for p in self.with_status("renamed")],
            "reordered": [m.to_json() for m in self.reordered],
            "patches": [p.to_json() for p in self.patches],
            "unusable": [{"name": n, "why": why} for n, why in self.unusable],
        }


@dataclass(frozen=True)
class UpstreamReview:
    """vendor/sglang.lock changed: a rebase."""

    old: str | None
    new: str | None
    old_from: str | None  # the lock's tree_from
    new_from: str | None
    report: str | None  # where the rebase report was found
    summary: tuple[str, ...]  # its summary lines

    def to_json(self) -> dict[str, Any]:
        return {
            "old": self.old,
            "new": self.new,
            "old_from": self.old_from,
            "new_from": self.new_from,
            "report": self.report,
            "summary": list(self.summary),
        }


@dataclass(frozen=True)
class Decision:
    decision: str
    reason: str
    patch: str | None
    evidence: tuple[str, ...]

    def to_json(self) -> dict[str, Any]:
        return {
            "decision": self.decision,
            "reason": self.reason,
            "patch": self.patch,
            "evidence": list(self.evidence),
        }


@dataclass(frozen=True)
class DecisionChange:
    kind: str  # added | removed | changed
    where: str  # the policy entry: file, function, condition (or a default's scope)
    old: Decision | None
    new: Decision | None

    def to_json(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "where": self.where,
            "old": self.old.to_json() if self.old else None,
            "new": self.new.to_json() if self.new else None,
        }


@dataclass(frozen=True)
class GateScan:
    scope: str  # full | limited
    files: tuple[str, ...]  # limited: the files scanned
    base_gates: int
    head_gates: int
    diff: GateDiff

    def to_json(self) -> dict[str, Any]:
        return {
            "scope": self.scope,
            "files": list(self.files),
            "base_gates": self.base_gates,
            "head_gates": self.head_gates,
            **self.diff.to_json(),
        }


@dataclass(frozen=True)
class Row:
    scenario: str
    field: str
    patch: str | None
    note: str | None
    cells: tuple[tuple[str, str], ...]  # (architecture, value as the table writes it)

    @property
    def key(self) -> tuple[str, str]:
        return (self.scenario, self.field)

    def cell(self, arch: str) -> str | None:
        return dict(self.cells).get(arch)

    def to_json(self) -> dict[str, Any]:
        return {
            "scenario": self.scenario,
            "field": self.field,
            "patch": self.patch,
            "note": self.note,
            "cells": dict(self.cells),
        }


@dataclass(frozen=True)
class RowChange:
    old: Row
    new: Row
    archs: tuple[str, ...]  # the architectures whose cell changed

    def to_json(self) -> dict[str, Any]:
        return {
            **self.new.to_json(),
            "old_patch": self.old.patch,
            "changed": {a: [self.old.cell(a), self.new.cell(a)] for a in self.archs},
        }


@dataclass(frozen=True)
class BehaviourReview:
    added: tuple[Row, ...]
    removed: tuple[Row, ...]
    changed: tuple[RowChange, ...]
    orphaned: tuple[Row, ...]  # HEAD's rows naming a patch HEAD's series does not have

    def to_json(self) -> dict[str, Any]:
        return {
            "added": [r.to_json() for r in self.added],
            "removed": [r.to_json() for r in self.removed],
            "changed": [c.to_json() for c in self.changed],
            "orphaned": [r.to_json() for r in self.orphaned],
        }


@dataclass(frozen=True)
class CheckReview:
    clean: bool
    findings: tuple[str, ...]

    def to_json(self) -> dict[str, Any]:
        return {"clean": self.clean, "findings": list(self.findings)}


@dataclass(frozen=True)
class Verdict:
    line: str
    sm12x: tuple[str, ...]  # each SM12x behaviour that changes
    other_archs: tuple[str, ...]  # each sm80-sm103 change (there should be none)

    def to_json(self) -> dict[str, Any]:
        return {"line": self.line, "sm12x": list(self.sm12x), "other_archs": list(self.other_archs)}


@dataclass(frozen=True)
class Review:
    base: RevInfo
    head: RevInfo
    verdict: Verdict
    series: SeriesReview
    upstream: UpstreamReview | None
    decisions: tuple[DecisionChange, ...]
    gates: GateScan
    behaviour: BehaviourReview
    checks: CheckReview

    def to_json(self) -> dict[str, Any]:
        return {
            "base": self.base.to_json(),
            "head": self.head.to_json(),
            "verdict": self.verdict.to_json(),
            "series": self.series.to_json(),
            "upstream": self.upstream.to_json() if self.upstream else None,
            "gates": {
                "decisions": [d.to_json() for d in self.decisions],
                "scan": self.gates.to_json(),
            },
            "behaviour": self.behaviour.to_json(),
            "checks": self.checks.to_json(),
        }
