"""A helper the patch calls that upstream removed, rewritten to upstream's platform object.

0.5.19 replaced the `is_sm*_supported()` helpers of `deep_gemm_wrapper` by
`get_platform()`, and 0.5.21 stopped importing `is_sm120_supported` into
`arg_groups/overrides.py`: a patch line `elif is_sm120_supported():` carried
there is a NameError. When names.py finds that every broken name on the
patch's lines is such a helper, called bare (`h()`), and the file already
uses `get_platform` (so no import has to be guessed), each call becomes the
platform fact the gate scanner maps to the same helper (runtime_context's
probes, gates/semantics.PLATFORM_FACTS): `get_platform().is_sm120`. Anything
else (another name, a helper passed around uncalled, no `get_platform` in the
file) stays for names.py's conflict.
"""

from __future__ import annotations

import ast
import re
from dataclasses import replace

from sm120fork.gates.semantics import HELPER_FACTS as FACTS
from sm120fork.patches.applier import write_changes
from sm120fork.rebase.names import Breakage, broken_lines
from sm120fork.rebase.strategy import CarriedPatch, CarryContext, Outcome, finish

NAME = "platform-helper"
_UNDEFINED = re.compile(r"^undefined name `(\w+)`$")


def rewrite(
    ctx: CarryContext, patch: CarriedPatch, outcome: Outcome, broken: list[Breakage]
) -> Outcome | None:
    """`outcome` with its broken helper calls rewritten (a new commit on the tip), or
    None with the work tree and HEAD left at `outcome.commit`."""
    helpers = {b.file: set[str]() for b in broken}
    for b in broken:
        found = _UNDEFINED.match(b.problem)
        if found is None or found.group(1) not in FACTS:
            return None
        helpers[b.file].add(found.group(1))
    edits: dict[str, str] = {}
    for path, names in helpers.items():
        text = ctx.repo.read(outcome.commit, path) or ""
        lines = text.splitlines(keepends=True)
        if not _uses_get_platform(text):
            return None  # which import would be upstream's? a person knows
        for b in (b for b in broken if b.file == path):
            line = lines[b.line - 1]
            for name in names:
                line = re.sub(rf"\b{name}\(\)", f"get_platform().{FACTS[name]}", line)
            if any(re.search(rf"\b{name}\b", line) for name in names):
                return None  # used other than as a bare call
            lines[b.line - 1] = line
        edits[path] = "".join(lines)
    ctx.repo.git("reset", "-q", "--soft", ctx.tip)
    write_changes(ctx.repo.root, edits)
    called = sorted({n for ns in helpers.values() for n in ns})
    said = ", ".join(f"{n}() -> get_platform().{FACTS[n]}" for n in called)
    reason = (
        f"{outcome.reason}; its own lines called {', '.join(called)}, which {ctx.version} no "
        f"longer defines there: rewritten as upstream now writes it ({said})"
    )
    # Its text changed, so it no longer applied "as it was" (clean, offset).
    status = "merged" if outcome.status in ("clean", "offset") else outcome.status
    repaired = finish(ctx, patch.parsed, status, reason, f"{outcome.strategy}+{NAME}")
    if not repaired.commit or broken_lines(ctx.repo, ctx.tip, repaired.commit, ctx.previous):
        _restore(ctx, outcome)
        return None
    return replace(repaired, conflicts=outcome.conflicts)


def _restore(ctx: CarryContext, outcome: Outcome) -> None:
    ctx.repo.git("reset", "-q", "--hard", outcome.commit)


def _uses_get_platform(text: str) -> bool:
    try:
        tree = ast.parse(text)
    except SyntaxError:
        return False
    return any(
        isinstance(node, ast.ImportFrom) and any(a.name == "get_platform" for a in node.names)
        for node in ast.walk(tree)
    )
