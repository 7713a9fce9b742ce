"""The records of the gate inventory: architectures, gate sites, inventories.

Everything here is immutable. A `Gate` is what docs/contract.md "The gate inventory"
describes, plus its identity (`key`, `id`) and the scanner's view of the code
it guards (`Guarded`), which the policy and the release diff use but the
JSON leaves out.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field, replace
from typing import Any, NamedTuple

from sm120fork import jsondata
from sm120fork.gates.answer import Answer
from sm120fork.jsondata import JsonObject

DECISIONS = ("patched", "excluded", "included", "upstream-ok", "open")
UNREVIEWED = "unreviewed"
# Reviewed, and SM12x is wrong there with no fix yet: `gates` fails on it.
OPEN = "open"


class Arch(NamedTuple):
    name: str
    major: int
    minor: int

    @property
    def sm(self) -> int:
        """What sglang's `get_device_sm()` returns: major * 10 + minor."""
        return self.major * 10 + self.minor


# docs/sm120-gates.md "Architectures covered"; every arch runs a CUDA new enough
# for the helpers (12.8), which is what the helpers' names promise.
ARCHS: tuple[Arch, ...] = (
    Arch("sm80", 8, 0),
    Arch("sm89", 8, 9),
    Arch("sm90", 9, 0),
    Arch("sm100", 10, 0),
    Arch("sm103", 10, 3),
    Arch("sm120", 12, 0),
    Arch("sm121", 12, 1),
)
SM12X = ("sm120", "sm121")


@dataclass(frozen=True)
class Guarded:
    """What a gate guards, as the scanner saw it (not written to JSON).

    `taken_true` / `taken_false`: lower-cased identifiers and string literals
    of the code that runs when the condition is true / false (None: nothing
    to judge, e.g. the false branch is an `elif`, itself a gate). `rejects`:
    the true branch only raises (a guard clause such as `if not
    is_sm100_supported(): raise ...`). `text`: normalised text of the guarded
    code, for similarity between releases. `context`: for a guard clause, the
    enclosing `if` test and the function (what passing the guard leads to).
    """

    taken_true: tuple[str, ...] | None = None
    taken_false: tuple[str, ...] | None = None
    rejects: bool = False
    text: str = ""
    context: tuple[str, ...] = ()  # a guard clause's surroundings: enclosing test, function


class GateKey(NamedTuple):
    """A gate's identity: survives line shifts and reformatting."""

    file: str
    function: str
    condition: str
    occurrence: int


@dataclass(frozen=True)
class Gate:
    file: str  # repository-relative: python/sglang/...
    line: int
    function: str  # qualified: Class.method, outer.inner, <module>
    kind: str  # if, elif, while, ternary, assert, return, flag, assign, expr, comprehension
    condition: str  # ast.unparse of the condition
    archs: dict[str, Answer]  # architecture -> its answer
    occurrence: int = 0  # index among gates with the same file, function, condition
    within: str | None = None  # test of the innermost enclosing `if` (tells repeats apart)
    guarded: Guarded = field(default_factory=Guarded, compare=False, repr=False)
    decision: str = UNREVIEWED
    patch: str | None = None
    reason: str | None = None
    evidence: tuple[str, ...] = ()
    wrongly_included: bool = False
    wrongly_included_token: str | None = None

    @property
    def key(self) -> GateKey:
        return GateKey(self.file, self.function, self.condition, self.occurrence)

    @property
    def id(self) -> str:
        raw = "\0".join(map(str, self.key)).encode()
        return hashlib.sha1(raw, usedforsecurity=False).hexdigest()[:12]

    @property
    def where(self) -> str:
        return f"{self.file}:{self.line}"

    def with_changes(self, **changes: Any) -> Gate:
        return replace(self, **changes)

    def to_json(self) -> dict[str, object]:
        return {
            "id": self.id,
            "file": self.file,
            "line": self.line,
            "function": self.function,
            "kind": self.kind,
            "condition": self.condition,
            "occurrence": self.occurrence,
            "within": self.within,
            "archs": {arch: answer.to_json() for arch, answer in self.archs.items()},
            "decision": self.decision,
            "patch": self.patch,
            "reason": self.reason,
            "evidence": list(self.evidence),
            "wrongly_included": self.wrongly_included,
            "wrongly_included_token": self.wrongly_included_token,
        }

    @classmethod
    def from_json(cls, data: JsonObject) -> Gate:
        """Read back one object of gates.json (the guarded code is not stored)."""
        archs = jsondata.obj(data["archs"])
        return cls(
            file=jsondata.text(data, "file"),
            line=jsondata.integer(data, "line"),
            function=jsondata.text(data, "function"),
            kind=jsondata.text(data, "kind", "if"),
            condition=jsondata.text(data, "condition"),
            archs={arch: Answer.from_json(value) for arch, value in archs.items()},
            occurrence=jsondata.integer(data, "occurrence", 0),
            within=jsondata.optional_text(data, "within"),
            decision=jsondata.text(data, "decision", UNREVIEWED),
            patch=jsondata.optional_text(data, "patch"),
            reason=jsondata.optional_text(data, "reason"),
            evidence=jsondata.texts(data, "evidence"),
            wrongly_included=jsondata.flag(data, "wrongly_included"),
            wrongly_included_token=jsondata.optional_text(data, "wrongly_included_token"),
        )


@dataclass(frozen=True)
class ScanProblem:
    """A file the scanner could not read or analyse: a finding, never a crash."""

    file: str
    message: str

    def __str__(self) -> str:
        return f"{self.file}: {self.message}"


@dataclass(frozen=True)
class Inventory:
    root: str  # the tree that was scanned (its directory holding python/sglang)
    gates: tuple[Gate, ...]
    problems: tuple[ScanProblem, ...] = ()
    files_total: int = 0
    files_parsed: int = 0
    unknown_helpers: tuple[str, ...] = ()  # is_sm*/is_blackwell*/... with no known meaning
    stale_policy: tuple[str, ...] = ()  # policy entries that matched no gate

    def with_gates(self, gates: tuple[Gate, ...], **changes: Any) -> Inventory:
        return replace(self, gates=gates, **changes)

    @property
    def unreviewed(self) -> tuple[Gate, ...]:
        return tuple(g for g in self.gates if g.decision == UNREVIEWED)

    @property
    def flagged(self) -> tuple[Gate, ...]:
        return tuple(g for g in self.gates if g.wrongly_included)


def assign_occurrences(gates: list[Gate]) -> tuple[Gate, ...]:
    """Number gates sharing (file, function, condition) in source order."""
    seen: dict[tuple[str, str, str], int] = {}
    result = []
    for gate in sorted(gates, key=lambda g: (g.file, g.line, g.condition)):
        triple = (gate.file, gate.function, gate.condition)
        index = seen.get(triple, 0)
        seen[triple] = index + 1
        result.append(replace(gate, occurrence=index))
    return tuple(result)
