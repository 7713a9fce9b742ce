"""Decisions of `patches/gates.toml` added, removed or changed from BASE to HEAD.

Entries are matched by what they decide about (a gate's file, function,
condition, `within` and occurrence; a function, file or glob default), never
by their place in the file, so moving an entry is no change.
"""

from __future__ import annotations

from sm120fork.gates import policy as rules
from sm120fork.review.model import Decision, DecisionChange


def _decision(found: rules.Decision) -> Decision:
    return Decision(found.decision, found.reason, found.patch, found.evidence)


def entries(policy: rules.Policy) -> dict[str, Decision]:
    """Every decision of the policy, by a readable name of what it decides about."""
    found: dict[str, Decision] = {}
    for gate in policy.gates:
        where = f"{gate.file}: {gate.function}: `{gate.condition}`"
        if gate.within is not None:
            where += f" within `{gate.within}`"
        if gate.occurrence is not None:
            where += f" (occurrence {gate.occurrence})"
        found[where] = _decision(gate.decision)
    for (path, function), decision in policy.functions.items():
        found[f"{path}: {function} (every gate of the function)"] = _decision(decision)
    for path, decision in policy.files.items():
        found[f"{path} (every gate of the file)"] = _decision(decision)
    for pattern, decision in policy.globs:
        found[f"{pattern} (every gate of these files)"] = _decision(decision)
    return found


def changes(old: rules.Policy, new: rules.Policy) -> tuple[DecisionChange, ...]:
    before, after = entries(old), entries(new)
    found = [
        DecisionChange("removed", where, before[where], None)
        for where in before
        if where not in after
    ]
    for where, decision in after.items():
        if where not in before:
            found.append(DecisionChange("added", where, None, decision))
        elif before[where] != decision:
            found.append(DecisionChange("changed", where, before[where], decision))
    return tuple(sorted(found, key=lambda c: (c.where, c.kind)))
