"""The review policy, `patches/gates.toml`: the fork's decision for every gate.

    [wrongly_included]
    tokens = ["trtllm", "deep_gemm", ...]   # what SM12x cannot run (see the file)

    [[file]]
    path = "python/sglang/srt/layers/communicator.py"
    decision = "upstream-ok"                # optional: the file's default
    reason = "..."

    [[file.function]]                        # optional: a function's default
    name = "Class.method"
    decision = "excluded"
    reason = "..."

    [[file.gate]]                            # one gate
    function = "apply_flashinfer_allreduce_fusion"
    condition = "(_is_sm90_supported or _is_sm100_supported) and ..."  # ast.unparse
    within = "model_arch in ['Glm4MoeForCausalLM']"  # optional: the enclosing `if` test
    occurrence = 0                           # optional: omitted = every occurrence
    decision = "patched"                     # patched | excluded | included | upstream-ok
    patch = "sm120-allreduce-fusion-guard.patch"   # with (and only with) patched
    reason = "..."
    evidence = ["https://github.com/sgl-project/sglang/issues/15650"]
    false_positive = "..."                   # optional: why a wrongly-included flag is wrong
    added = true                             # optional, with patched: the patch adds this
                                             # gate (upstream has none there to review)

A gate is identified by file, enclosing function and normalised condition
(plus the occurrence among equal triples), never by its line, so entries
survive line shifts and reformatting. Where one function repeats a condition
(`is_sm100_supported()` seven times in `_handle_model_specific_adjustments`),
`within` (the enclosing `if` test) tells the repeats apart more durably than
`occurrence`, which shifts when upstream adds one more; with `within`,
`occurrence` counts only the gates sharing that enclosing test. A `path` with `*` is a glob
(`**` crosses directories) and may only carry a default; the most specific
entry wins: gate, function, file, then the longest glob (`decide.apply_policy`).

An `added` entry reviews a gate that only the patched tree has (a patch that
gives SM12x a default where upstream tests no architecture at all): it is not
stale in the upstream tree, and `unmatched_added` checks it against the patched
sources instead.
"""

from __future__ import annotations

import ast
import tomllib
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sm120fork.errors import FatalError
from sm120fork.gates.model import DECISIONS, Gate
from sm120fork.gates.scan import scan_source


@dataclass(frozen=True)
class Decision:
    decision: str
    reason: str
    patch: str | None = None
    evidence: tuple[str, ...] = ()
    false_positive: str | None = None
    origin: str = ""  # where in the policy: for stale-entry reports


@dataclass(frozen=True)
class GateRule:
    file: str
    function: str
    condition: str
    occurrence: int | None
    within: str | None
    decision: Decision
    added: bool = False  # the gate exists only in the patched tree (see the module doc)

    def matches(self, gate: Gate, local: int) -> bool:
        """`local`: the gate's index among equal gates with the same `within`;
        with `within` given, `occurrence` counts there."""
        if self.within is not None and self.within != gate.within:
            return False
        index = local if self.within is not None else gate.occurrence
        return self.occurrence is None or self.occurrence == index

    @property
    def specificity(self) -> int:
        return (self.within is not None) * 2 + (self.occurrence is not None)


@dataclass(frozen=True)
class Policy:
    tokens: tuple[str, ...] = ()
    gates: tuple[GateRule, ...] = ()
    functions: dict[tuple[str, str], Decision] = field(default_factory=dict)
    files: dict[str, Decision] = field(default_factory=dict)
    globs: tuple[tuple[str, Decision], ...] = ()  # longest pattern first
    source: str = ""

    @property
    def added(self) -> tuple[GateRule, ...]:
        return tuple(rule for rule in self.gates if rule.added)

    @property
    def patches(self) -> set[str]:
        named = [r.decision.patch for r in self.gates]
        named += [d.patch for d in (*self.functions.values(), *self.files.values())]
        named += [d.patch for _, d in self.globs]
        return {p for p in named if p}


_DECISION_KEYS = {"decision", "reason", "patch", "evidence", "false_positive"}


def normalise_condition(text: str) -> str:
    """The condition as `ast.unparse` writes it (what the scanner records)."""
    try:
        return ast.unparse(ast.parse(text.strip(), mode="eval").body)
    except SyntaxError as error:
        raise FatalError(f"policy condition is not a Python expression: {text!r}") from error


def _decision(table: dict[str, Any], where: str, *, required: bool = True) -> Decision | None:
    if "decision" not in table:
        if required:
            raise FatalError(f"{where}: no decision")
        return None
    decision = table["decision"]
    if decision not in DECISIONS:
        raise FatalError(f"{where}: decision {decision!r} is not one of {', '.join(DECISIONS)}")
    reason = table.get("reason")
    if not isinstance(reason, str) or not reason.strip():
        raise FatalError(f"{where}: every decision needs a reason")
    if reason.lstrip().lower().startswith("open") and decision != "open":
        raise FatalError(
            f"{where}: the reason says the gate is open but the decision is {decision!r}; "
            'use decision = "open" (which fails `gates`) or write the resolution'
        )
    patch = table.get("patch")
    if (decision == "patched") != bool(patch):
        raise FatalError(f"{where}: a patch is named with, and only with, decision patched")
    evidence = table.get("evidence", [])
    if not isinstance(evidence, list) or not all(isinstance(e, str) for e in evidence):
        raise FatalError(f"{where}: evidence is a list of URLs")
    false_positive = table.get("false_positive")
    return Decision(decision, reason.strip(), patch, tuple(evidence), false_positive, where)


def _check_keys(table: dict[str, Any], allowed: set[str], where: str) -> None:
    unknown = set(table) - allowed
    if unknown:
        raise FatalError(f"{where}: unknown key(s) {', '.join(sorted(unknown))}")


def load_policy(path: Path) -> Policy:
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return Policy(source=str(path))
    return policy_from_text(text, str(path))


def policy_from_text(text: str | None, source: str) -> Policy:
    """The one parser of patches/gates.toml (a file, or its text at a git revision);
    no text is an empty policy."""
    if text is None:
        return Policy(source=source)
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as error:
        raise FatalError(f"{source}: {error}; fix it there") from error
    return parse_policy(data, source)


def parse_policy(data: dict[str, Any], source: str = "gates.toml") -> Policy:
    _check_keys(data, {"wrongly_included", "file"}, source)
    tokens = tuple(t.lower() for t in data.get("wrongly_included", {}).get("tokens", []))
    gates: list[GateRule] = []
    functions: dict[tuple[str, str], Decision] = {}
    files: dict[str, Decision] = {}
    globs: list[tuple[str, Decision]] = []
    seen: set[tuple[str, str, str, int | None, str | None]] = set()
    for index, entry in enumerate(data.get("file", []), start=1):
        path = entry.get("path")
        where = f"{source}: [[file]] #{index} ({path})"
        if not isinstance(path, str):
            raise FatalError(f"{where}: no path")
        _check_keys(entry, {"path", "function", "gate"} | _DECISION_KEYS, where)
        default = _decision(entry, where, required=False)
        if "*" in path:
            if default is None or "function" in entry or "gate" in entry:
                raise FatalError(f"{where}: a glob path carries only a default decision")
            globs.append((path, default))
            continue
        if default is not None:
            if path in files:
                raise FatalError(f"{where}: a second default for this file")
            files[path] = default
        for f_index, fn in enumerate(entry.get("function", []), start=1):
            f_where = f"{where} function #{f_index} ({fn.get('name')})"
            _check_keys(fn, {"name"} | _DECISION_KEYS, f_where)
            name = fn.get("name")
            if not isinstance(name, str):
                raise FatalError(f"{f_where}: no name")
            if (path, name) in functions:
                raise FatalError(f"{f_where}: a second default for this function")
            decision = _decision(fn, f_where)
            assert decision is not None
            functions[(path, name)] = decision
        for g_index, gate in enumerate(entry.get("gate", []), start=1):
            g_where = f"{where} gate #{g_index} ({gate.get('function')})"
            keys = {"function", "condition", "occurrence", "within", "added"}
            _check_keys(gate, keys | _DECISION_KEYS, g_where)
            function, condition = gate.get("function"), gate.get("condition")
            if not isinstance(function, str) or not isinstance(condition, str):
                raise FatalError(f"{g_where}: a gate needs function and condition")
            occurrence = gate.get("occurrence")
            if occurrence is not None and (not isinstance(occurrence, int) or occurrence < 0):
                raise FatalError(f"{g_where}: occurrence is a number from 0")
            within = gate.get("within")
            if within is not None:
                within = normalise_condition(within)
            key = (path, function, normalise_condition(condition), occurrence, within)
            if key in seen:
                raise FatalError(f"{g_where}: this gate has a second entry")
            seen.add(key)
            decision = _decision(gate, g_where)
            assert decision is not None
            added = gate.get("added", False)
            if not isinstance(added, bool) or (added and decision.decision != "patched"):
                raise FatalError(f"{g_where}: added is true or false, true only with patched")
            gates.append(GateRule(path, function, key[2], occurrence, within, decision, added))
    globs.sort(key=lambda item: -len(item[0]))
    return Policy(tokens, tuple(gates), functions, files, tuple(globs), source)


def missing_patches(policy: Policy, series_names: Iterable[str]) -> list[str]:
    """Patches the policy names that the series does not list."""
    listed = set(series_names)
    return sorted(p for p in policy.patches if p not in listed)


def unmatched_added(policy: Policy, read: Callable[[str], str | None]) -> list[str]:
    """The `added` entries that match no gate of their file in the patched tree;
    `read` gives a file's patched text (None: the file does not exist)."""
    unmatched = []
    for path in sorted({rule.file for rule in policy.added}):
        text = read(path)
        gates = scan_source(text, path) if text is not None else ()
        for rule in (r for r in policy.added if r.file == path):
            if not any(
                (g.function, g.condition) == (rule.function, rule.condition)
                and rule.matches(g, g.occurrence)
                for g in gates
            ):
                unmatched.append(rule.decision.origin)
    return unmatched
