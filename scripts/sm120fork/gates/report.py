"""Write the inventory (and a release diff) as JSON and Markdown.

`build/gates/gates.json` is the list docs/contract.md fixes, one object per gate;
`summary.json` holds the counts and findings (unreviewed, wrongly included,
scan problems, stale policy entries); `gates.md` is the readable table,
findings first. A diff between releases goes to `diff.json` / `diff.md`.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any

from sm120fork.gates.answer import Answer
from sm120fork.gates.diff import GateDiff
from sm120fork.gates.model import ARCHS, DECISIONS, UNREVIEWED, Gate, Inventory
from sm120fork.markdown import cell


def needs_attention(gate: Gate) -> bool:
    """Flagged as wrongly included, and not patched or excluded by the fork."""
    return gate.wrongly_included and gate.decision not in ("patched", "excluded")


def summary(inventory: Inventory) -> dict[str, Any]:
    decisions = Counter(g.decision for g in inventory.gates)
    return {
        "root": inventory.root,
        "files_total": inventory.files_total,
        "files_parsed": inventory.files_parsed,
        "gates": len(inventory.gates),
        "files_with_gates": len({g.file for g in inventory.gates}),
        "decisions": {d: decisions.get(d, 0) for d in (*DECISIONS, UNREVIEWED)},
        "unreviewed": [g.id for g in inventory.unreviewed],
        "wrongly_included": [g.id for g in inventory.flagged],
        "needs_attention": [g.id for g in inventory.gates if needs_attention(g)],
        "problems": [str(p) for p in inventory.problems],
        "stale_policy": list(inventory.stale_policy),
        "unknown_helpers": list(inventory.unknown_helpers),
    }


def _json(data: object) -> str:
    return json.dumps(data, indent=2, ensure_ascii=False) + "\n"


def write_reports(inventory: Inventory, out_dir: Path, diff: GateDiff | None = None) -> list[Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    written = {
        out_dir / "gates.json": _json([g.to_json() for g in inventory.gates]),
        out_dir / "summary.json": _json(summary(inventory)),
        out_dir / "gates.md": render_markdown(inventory),
    }
    if diff is not None:
        written[out_dir / "diff.json"] = _json(diff.to_json())
        written[out_dir / "diff.md"] = render_diff(diff)
    else:  # a diff from an earlier run would no longer match these gates
        for stale in ("diff.json", "diff.md"):
            (out_dir / stale).unlink(missing_ok=True)
    for path, text in written.items():
        path.write_text(text, encoding="utf-8")
    return list(written)


def _arch(answer: Answer | None) -> str:
    """The table's cell: what depends on other inputs (or was not evaluated) is `?`."""
    if answer is None or answer.word == "depends":
        return "?"
    return answer.word


def _gate_line(gate: Gate) -> str:
    return f"`{gate.where}` {gate.function}: `{cell(gate.condition, 100)}`"


def render_markdown(inventory: Inventory) -> str:
    info = summary(inventory)
    out = [
        "# Architecture gates",
        "",
        f"{info['gates']} gates in {info['files_with_gates']} files "
        f"({inventory.files_parsed} of {inventory.files_total} Python files parsed).",
        "",
        "| decision | gates |",
        "|---|---|",
        *(f"| {d} | {n} |" for d, n in info["decisions"].items()),
        "",
    ]
    attention = [g for g in inventory.gates if needs_attention(g)]
    sections = [
        ("Unreviewed", inventory.unreviewed, "no entry in patches/gates.toml"),
        ("Wrongly included, not patched or excluded", attention, None),
    ]
    for title, gates, note in sections:
        out += [f"## {title} ({len(gates)})", ""]
        for gate in gates:
            extra = note or f"admits SM12x into `{gate.wrongly_included_token}` ({gate.decision})"
            out.append(f"- {_gate_line(gate)} - {extra}")
        out.append("")
    flagged = inventory.flagged
    out += [f"## Wrongly included: every flag ({len(flagged)})", ""]
    out += [
        f"- {_gate_line(g)} - `{g.wrongly_included_token}`, {g.decision}: {cell(g.reason, 120)}"
        for g in flagged
    ]
    out.append("")
    if inventory.problems or inventory.stale_policy or inventory.unknown_helpers:
        out += ["## Findings", ""]
        out += [f"- scan: {p}" for p in inventory.problems]
        out += [f"- policy entry matches no gate: {s}" for s in inventory.stale_policy]
        out += [f"- helper of unknown meaning: `{h}`" for h in inventory.unknown_helpers]
        out.append("")
    out += ["## All gates", ""]
    header = "| line | function | condition | " + " | ".join(a.name for a in ARCHS)
    divider = "|---|---|---|" + "---|" * len(ARCHS) + "---|---|"
    current = None
    for gate in inventory.gates:
        if gate.file != current:
            current = gate.file
            out += ["", f"### {gate.file}", "", header + " | decision | reason |", divider]
        cells = [
            str(gate.line),
            cell(gate.function, 60),
            f"`{cell(gate.condition, 90)}`",
            *(_arch(gate.archs.get(a.name)) for a in ARCHS),
            gate.decision + (f" ({gate.patch})" if gate.patch else ""),
            cell(gate.reason, 120),
        ]
        out.append("| " + " | ".join(cells) + " |")
    out += [
        "",
        "yes / no: the condition on that architecture; ? depends on other inputs "
        "(gates.json names them); raises: evaluating it fails there.",
        "",
    ]
    return "\n".join(out)


def render_diff(diff: GateDiff) -> str:
    data = diff.to_json()
    out = ["# Architecture gates between releases", ""]
    out += [
        f"- {key}: {len(data[key])}" for key in ("new", "removed", "changed", "moved", "unreviewed")
    ]
    out.append("")
    for change_kind in ("moved", "changed"):
        out += [f"## {change_kind.capitalize()}", ""]
        for change in getattr(diff, change_kind):
            out.append(
                f"- {_gate_line(change.old)} -> {_gate_line(change.new)}"
                + (f" ({change.note})" if change.note else "")
            )
        out.append("")
    for kind in ("new", "removed", "unreviewed"):
        out += [f"## {kind.capitalize()}", ""]
        out += [f"- {_gate_line(g)}" for g in getattr(diff, kind)]
        out.append("")
    return "\n".join(out)
