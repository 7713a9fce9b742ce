"""Re-apply an intent to a tree whose code moved or was reformatted."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import libcst as cst

from sm120fork.intent.model import Intent
from sm120fork.intent.rewrite import GateMatch, IntentError, find_gates, rewrite_gate


@dataclass(frozen=True)
class Reapplied:
    status: str  # "resolved", "upstreamed" or "not-found"
    detail: str
    changes: dict[str, str] = field(default_factory=dict)  # path -> new text


def reapply(
    intent: Intent, read: Callable[[str], str | None], candidates: Iterable[str]
) -> Reapplied:
    """Find the intent's gate in `intent.files` first, then in `candidates`, and rewrite it."""
    searched: list[str] = []
    for path in dict.fromkeys([*intent.files, *candidates]):
        text = read(path)
        if text is None or intent.anchor not in text:
            continue
        searched.append(path)
        try:
            module = cst.parse_module(text)
        except cst.ParserSyntaxError:
            continue
        matches = find_gates(module, intent)
        if not matches:
            continue
        return _resolve(intent, path, module, matches)
    where = ", ".join(searched) or "no file naming the anchor"
    return Reapplied(
        "not-found",
        f"no gate admitting {intent.gate_admits} under {intent.anchor!r} (searched {where})",
    )


def _resolve(intent: Intent, path: str, module: cst.Module, matches: list[GateMatch]) -> Reapplied:
    pending = [m for m in matches if not m.already_included]
    if not pending:
        condition = module.code_for_node(matches[0].node.test).strip()
        return Reapplied(
            "upstreamed",
            f"upstream's gate `{condition}` in {path} already admits {intent.include}",
        )
    if len(pending) > 1:
        return Reapplied(
            "not-found",
            f"{len(pending)} gates in {path} fit {intent.anchor!r}; the intent is ambiguous there",
        )
    try:
        rewritten = rewrite_gate(module, pending[0], intent)
    except IntentError as error:
        return Reapplied(
            "not-found", f"the gate in {path} no longer fits the intent: {error.message}"
        )
    return Reapplied(
        "resolved",
        f"re-applied intent in {path}: {intent.says}",
        {path: rewritten.code},
    )
