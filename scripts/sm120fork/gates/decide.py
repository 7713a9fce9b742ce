"""Apply the review policy to an inventory: each gate gets the decision of the
most specific entry that matches it (gate, function, file, then the longest
glob), entries that match nothing are reported stale, and the wrongly-included
check runs on the result.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from sm120fork.gates.answer import NO, YES
from sm120fork.gates.model import SM12X, UNREVIEWED, Gate, Inventory
from sm120fork.gates.policy import Decision, GateRule, Policy

# ---- Wrongly included: a gate that lets SM12x into code for kernels it lacks.
#
# For sm120 and sm121 the gate's answer says which code runs there: the true
# branch when the condition is true (or depends on something else), the false
# branch when it is false. A true branch that only raises is a refusal, not an
# inclusion; a guard clause (`if not is_blackwell_supported(): raise`) that
# SM12x passes lets it into what the surrounding code selects (the enclosing
# `if`, the error message). If that code names one of the policy's tokens
# (`trtllm`, `deep_gemm`, `flashmla`, ...), the gate is flagged with the token.


def taken_words(gate: Gate, arch: str) -> tuple[str, ...]:
    """The words of the code `arch` runs because of this gate.

    False: the false branch. True: the true branch, unless it only refuses.
    Depends (on something other than the architecture): the true branch, or
    for a guard clause what passing it leads to (the architecture lets it
    through; whatever else it depends on may too).
    """
    answer = gate.archs.get(arch)
    guarded = gate.guarded
    if answer is not None and answer.word == "raises":
        return ()  # neither branch runs: the condition itself fails there
    if answer == NO:
        return guarded.taken_false or ()
    if guarded.rejects:
        # passing for sure: what the refusal names is what is let through;
        # passing maybe: only the surroundings say what (the refused case may
        # be the very thing the other inputs select, `backend == "fa3" and ...`)
        return guarded.context if answer != YES else ()
    return guarded.taken_true or ()


def check_wrongly_included(gate: Gate, tokens: Sequence[str]) -> str | None:
    """The first token named by code SM12x reaches through this gate, if any."""
    if not tokens:
        return None
    for arch in SM12X:
        words = taken_words(gate, arch)
        if not words:
            continue
        for token in tokens:
            if any(token in word for word in words):
                return token
    return None


def _glob_match(path: str, pattern: str) -> bool:
    if "**" in pattern:
        prefix = pattern.split("**", 1)[0]
        return path.startswith(prefix) and fnmatch.fnmatchcase(path, pattern.replace("**", "*"))
    return fnmatch.fnmatchcase(path, pattern) and path.count("/") == pattern.count("/")


@dataclass
class _Matcher:
    policy: Policy
    used: set[str] = field(default_factory=set)

    def __post_init__(self) -> None:
        self.exact: dict[tuple[str, str, str], list[GateRule]] = {}
        for rule in self.policy.gates:
            triple = (rule.file, rule.function, rule.condition)
            self.exact.setdefault(triple, []).append(rule)

    def decide(self, gate: Gate, local: int) -> Decision | None:
        rules = self.exact.get((gate.file, gate.function, gate.condition), [])
        matching = [r for r in rules if r.matches(gate, local)]
        if matching:
            rule = max(matching, key=lambda r: r.specificity)
            self.used.add(rule.decision.origin)
            return rule.decision
        for found in (
            self.policy.functions.get((gate.file, gate.function)),
            self.policy.files.get(gate.file),
        ):
            if found is not None:
                self.used.add(found.origin)
                return found
        for pattern, decision in self.policy.globs:
            if _glob_match(gate.file, pattern):
                self.used.add(decision.origin)
                return decision
        return None

    def stale(self) -> list[str]:
        everything: Iterable[Decision] = (
            *(r.decision for r in self.policy.gates if not r.added),
            *self.policy.functions.values(),
            *self.policy.files.values(),
            *(d for _, d in self.policy.globs),
        )
        return sorted({d.origin for d in everything} - self.used)


def apply_policy(inventory: Inventory, policy: Policy) -> Inventory:
    """The inventory with each gate's decision, and the wrongly-included check."""
    matcher = _Matcher(policy)
    reviewed = []
    seen: dict[tuple[str, str, str, str | None], int] = {}
    for gate in inventory.gates:
        group = (gate.file, gate.function, gate.condition, gate.within)
        local = seen[group] = seen.get(group, -1) + 1
        decision = matcher.decide(gate, local)
        if decision is None:
            gate = gate.with_changes(decision=UNREVIEWED, patch=None, reason=None, evidence=())
        else:
            gate = gate.with_changes(
                decision=decision.decision,
                patch=decision.patch,
                reason=decision.reason,
                evidence=decision.evidence,
            )
        token = check_wrongly_included(gate, policy.tokens)
        if token is not None and decision is not None and decision.false_positive:
            token = None
        reviewed.append(
            gate.with_changes(wrongly_included=token is not None, wrongly_included_token=token)
        )
    return inventory.with_gates(tuple(reviewed), stale_policy=tuple(matcher.stale()))
