"""Compare the gates of two releases: `diff_inventories(old, new) -> GateDiff`.

Gates are paired in rounds, best pairs first:

1. the same identity (file, function, condition), occurrences paired by
   what they guard: unchanged, not reported;
2. *changed*: the same file and function, the condition rewritten (similar
   condition or similar guarded code);
3. *moved*: another file or function, the same condition (or one with the
   same answer on every architecture, e.g. `is_sm100_supported()` became
   `get_platform().is_sm100`) guarding similar code;
4. what is left is *removed* (old) or *new*.

*unreviewed* lists the new inventory's gates without a decision (apply the
policy to `new` first). Each change says which architectures' answers moved,
so "upstream now lets SM120 in here" is visible even when the text differs.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

from sm120fork import jsondata
from sm120fork.gates.answer import Answer, Word, word
from sm120fork.gates.model import SM12X, UNREVIEWED, Gate, Inventory
from sm120fork.jsondata import JsonObject

# An architecture's (old answer, new answer); None where a gate has no answer for it.
AnswerPair = tuple[Answer | None, Answer | None]

_WORD = re.compile(r"[A-Za-z_][A-Za-z0-9_]*|\d+|[^\sA-Za-z0-9_]")
CHANGED_COND_MIN = 0.5  # a changed gate: condition this similar,
CHANGED_BODY_MIN = 0.6  # or guarded code this similar
MOVED_COND_MIN = 0.6  # a moved gate: condition this similar and
MOVED_BODY_MIN = 0.3  # guarded code this similar


@dataclass(frozen=True)
class GateChange:
    old: Gate
    new: Gate
    score: float
    archs: dict[str, AnswerPair]  # architecture -> (old answer, new answer), where they differ

    @property
    def note(self) -> str:
        notes = []
        for arch in SM12X:
            if arch in self.archs:
                before, after = self.archs[arch]
                notes.append(f"{arch}: {word(before)} -> {word(after)}")
        return "; ".join(notes)

    def to_json(self) -> dict[str, object]:
        return {
            "old": self.old.to_json(),
            "new": self.new.to_json(),
            "score": round(self.score, 3),
            "archs": {arch: [_json(a) for a in pair] for arch, pair in self.archs.items()},
            "note": self.note,
        }

    @classmethod
    def from_json(cls, data: JsonObject) -> GateChange:
        """Read back `to_json()` (the guarded code is not stored)."""
        return cls(
            old=Gate.from_json(jsondata.obj(data["old"])),
            new=Gate.from_json(jsondata.obj(data["new"])),
            score=jsondata.number(data, "score"),
            archs={
                arch: _answers_of(jsondata.array(pair))
                for arch, pair in jsondata.obj(data["archs"]).items()
            },
        )


@dataclass(frozen=True)
class GateDiff:
    new: tuple[Gate, ...]
    removed: tuple[Gate, ...]
    changed: tuple[GateChange, ...]
    moved: tuple[GateChange, ...]
    unreviewed: tuple[Gate, ...]

    def to_json(self) -> dict[str, list[dict[str, object]]]:
        """The `gates` object of the rebase report (docs/contract.md)."""
        return {
            "new": [g.to_json() for g in self.new],
            "changed": [c.to_json() for c in self.changed],
            "moved": [c.to_json() for c in self.moved],
            "removed": [g.to_json() for g in self.removed],
            "unreviewed": [g.to_json() for g in self.unreviewed],
        }

    @classmethod
    def from_json(cls, data: JsonObject) -> GateDiff:
        """Read back `to_json()`; a kind left out is empty."""

        def listed(kind: str) -> list[JsonObject]:
            return [jsondata.obj(item) for item in jsondata.array(data.get(kind, []))]

        return cls(
            new=tuple(Gate.from_json(g) for g in listed("new")),
            removed=tuple(Gate.from_json(g) for g in listed("removed")),
            changed=tuple(GateChange.from_json(c) for c in listed("changed")),
            moved=tuple(GateChange.from_json(c) for c in listed("moved")),
            unreviewed=tuple(Gate.from_json(g) for g in listed("unreviewed")),
        )

    @classmethod
    def empty(cls) -> GateDiff:
        return cls((), (), (), (), ())

    def of_kind(self, kind: str) -> tuple[Gate, ...] | tuple[GateChange, ...]:
        """The findings of one `to_json()` key: new, changed, moved, removed, unreviewed."""
        found: dict[str, tuple[Gate, ...] | tuple[GateChange, ...]] = {
            "new": self.new,
            "changed": self.changed,
            "moved": self.moved,
            "removed": self.removed,
            "unreviewed": self.unreviewed,
        }
        return found[kind]


def _json(answer: Answer | None) -> bool | str | None:
    return None if answer is None else answer.to_json()


def _answers_of(pair: list[object]) -> AnswerPair:
    old, new = (None if value is None else Answer.from_json(value) for value in pair)
    return old, new


_CAMEL = re.compile(r"[A-Z]+[a-z0-9]*|[a-z0-9]+")


def _tokens(text: str) -> frozenset[str]:
    """Words of the text; identifiers also split into their parts at `_` and
    CamelCase humps (a rename keeps its parts: Glm4MoeForCausalLM, _glm4_moe_overrides)."""
    words = _WORD.findall(text)
    parts = [
        p.lower()
        for w in words
        if len(w) > 3
        for chunk in w.split("_")
        for p in _CAMEL.findall(chunk)
    ]
    return frozenset(words + parts)


def _jaccard(a: frozenset[str], b: frozenset[str]) -> float:
    if not a and not b:
        return 1.0
    return len(a & b) / len(a | b)


def _answers(gate: Gate) -> tuple[Word, ...]:
    return tuple(answer.word for answer in gate.archs.values())


class _Features:
    def __init__(self, gate: Gate) -> None:
        self.gate = gate
        self.condition = _tokens(gate.condition)
        self.body = _tokens(gate.guarded.text)
        self.answers = _answers(gate)
        # Answers that single out architectures: some yes, mostly decided.
        decided = sum(a != "depends" for a in self.answers)
        self.decisive = "yes" in self.answers and decided >= len(self.answers) // 2

    def condition_score(self, other: _Features) -> float:
        """1 for the same text; high for the same answer on every architecture."""
        if self.gate.condition == other.gate.condition:
            return 1.0
        text = _jaccard(self.condition, other.condition)
        if self.decisive and self.answers == other.answers:
            return max(text, 0.6 + 0.4 * text)
        return text

    def body_score(self, other: _Features) -> float:
        if not self.body and not other.body:
            return 0.5  # nothing to compare (a gate read back from JSON)
        return _jaccard(self.body, other.body)


def _arch_changes(old: Gate, new: Gate) -> dict[str, AnswerPair]:
    """Architectures whose answer changed (yes / no / depends; not what it depends on)."""
    return {
        arch: (old.archs.get(arch), new.archs.get(arch))
        for arch in new.archs
        if word(old.archs.get(arch)) != word(new.archs.get(arch))
    }


def _pair(
    olds: list[_Features],
    news: list[_Features],
    score: Callable[[_Features, _Features], float | None],
    minimum: float,
    bucket: Callable[[Gate], object] = lambda gate: None,
) -> list[tuple[_Features, _Features, float]]:
    """Greedy best-first pairing of candidates (in the same bucket) scoring >= `minimum`."""
    by_bucket: dict[object, list[int]] = {}
    for j, new in enumerate(news):
        by_bucket.setdefault(bucket(new.gate), []).append(j)
    candidates = []
    for i, old in enumerate(olds):
        for j in by_bucket.get(bucket(old.gate), ()):
            value = score(old, news[j])
            if value is not None and value >= minimum:
                candidates.append((value, i, j))
    candidates.sort(key=lambda c: (-c[0], c[1], c[2]))
    used_old: set[int] = set()
    used_new: set[int] = set()
    pairs = []
    for value, i, j in candidates:
        if i in used_old or j in used_new:
            continue
        used_old.add(i)
        used_new.add(j)
        pairs.append((olds[i], news[j], value))
    return pairs


def _remaining(
    items: list[_Features], pairs: list[tuple[_Features, _Features, float]], side: int
) -> list[_Features]:
    taken = {id(p[side]) for p in pairs}
    return [f for f in items if id(f) not in taken]


def _identity(gate: Gate) -> object:
    return (gate.file, gate.function, gate.condition)


def _place(gate: Gate) -> object:
    return (gate.file, gate.function)


def _same(a: _Features, b: _Features) -> float:
    return 1.0 + a.body_score(b) - 0.001 * abs(a.gate.occurrence - b.gate.occurrence)


def _changed(a: _Features, b: _Features) -> float | None:
    condition, body = a.condition_score(b), a.body_score(b)
    if condition < CHANGED_COND_MIN and body < CHANGED_BODY_MIN:
        return None
    return 0.5 * condition + 0.5 * body


def _moved(a: _Features, b: _Features) -> float | None:
    condition = a.condition_score(b)
    if condition < MOVED_COND_MIN:
        return None
    body = a.body_score(b)
    if body < MOVED_BODY_MIN:
        return None
    return 0.5 * condition + 0.5 * body


def diff_inventories(old: Inventory, new: Inventory) -> GateDiff:
    olds = [_Features(g) for g in old.gates]
    news = [_Features(g) for g in new.gates]
    same = _pair(olds, news, _same, 0.0, _identity)
    olds, news = _remaining(olds, same, 0), _remaining(news, same, 1)
    changes = _pair(olds, news, _changed, 0.0, _place)
    olds, news = _remaining(olds, changes, 0), _remaining(news, changes, 1)
    moves = _pair(olds, news, _moved, 0.0)
    olds, news = _remaining(olds, moves, 0), _remaining(news, moves, 1)

    def change(pair: tuple[_Features, _Features, float]) -> GateChange:
        a, b, value = pair
        return GateChange(a.gate, b.gate, value, _arch_changes(a.gate, b.gate))

    def order(c: GateChange) -> tuple[str, int]:
        return (c.new.file, c.new.line)

    return GateDiff(
        new=tuple(f.gate for f in news),
        removed=tuple(f.gate for f in olds),
        changed=tuple(sorted((change(p) for p in changes), key=order)),
        moved=tuple(sorted((change(p) for p in moves), key=order)),
        unreviewed=tuple(g for g in new.gates if g.decision == UNREVIEWED),
    )
