"""Observations as Markdown: one table per scenario, one column per architecture.

Used to write gatetable/observed-<version>.md from a saved ``run --json`` file.
Errors and ``unavailable:`` values are long and repeat across cells, so a cell
shows ``E1``, ``E2``, ... and the texts follow the table; where building
ServerArgs raised, only the ``error`` row names it and the other fields show
``-``. Listed under the table instead of in it: fields the release does not have
(``<missing>`` everywhere), ``env.*`` fields with one value on every architecture,
and ``source.*`` (where a probe found its gate).
"""

from __future__ import annotations

from collections.abc import Sequence

from sm120fork.markdown import cell

from . import table


def _cell_text(value: table.Cell | table.Raised, notes: list[str]) -> str:
    if isinstance(value, table.Raised) or (
        isinstance(value, str) and value.startswith(table.UNAVAILABLE)
    ):
        note = f"raises `{value.message}`" if isinstance(value, table.Raised) else f"`{value}`"
        if note not in notes:
            notes.append(note)
        return f"E{notes.index(note) + 1}"
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    return cell(f"`{value}`", limit=None)


def scenario_table(scenario: str, observations: table.Observations, archs: Sequence[str]) -> str:
    """The Markdown table of one scenario's observed fields."""
    per_arch = [observations.get(a, {}).get(scenario) for a in archs]
    fields = sorted({f for obs in per_arch if obs for f in obs})
    cells = {f: [table.observed_cell(obs, f) for obs in per_arch] for f in fields}
    raised = [bool(obs and obs.get("error")) for obs in per_arch]

    def constant(field: str) -> bool:
        values = [v for v, r in zip(cells[field], raised, strict=True) if not r]
        return len({repr(v) for v in values}) <= 1

    missing = [
        f
        for f in fields
        if all(v == table.MISSING for v, r in zip(cells[f], raised, strict=True) if not r)
        and not all(raised)
    ]
    invariant_env = [f for f in fields if f.startswith("env.") and constant(f)]
    sources = [f for f in fields if f.startswith("source.")]
    notes: list[str] = []
    lines = [f"| field | {' | '.join(archs)} |", "|---" * (len(archs) + 1) + "|"]
    for field in fields:
        if field in missing or field in invariant_env or field in sources:
            continue
        row = [
            "-" if r and field != "error" else _cell_text(value, notes)
            for value, r in zip(cells[field], raised, strict=True)
        ]
        lines.append(f"| {field} | {' | '.join(row)} |")
    lines.append("")
    lines += [f"- E{n}: {note}" for n, note in enumerate(notes, start=1)]
    for field in sources:
        answered = sorted({str(v) for v in cells[field] if isinstance(v, str)})
        lines.append(f"- {field}: {', '.join(f'`{a}`' for a in answered)}")
    if missing:
        lines.append(f"- not in this release (`<missing>`): {', '.join(missing)}")
    if invariant_env:
        lines.append(f"- same on every architecture (omitted): {', '.join(invariant_env)}")
    return "\n".join(lines).rstrip() + "\n"


def markdown(
    observations: table.Observations, archs: Sequence[str], scenarios: Sequence[str] = ()
) -> str:
    names = scenarios or sorted({s for arch in archs for s in observations.get(arch, {})})
    return "\n".join(f"### {name}\n\n{scenario_table(name, observations, archs)}" for name in names)
