"""The expectation table (expectations.toml): loading, checking, comparing.

The file's own header documents the format for people who edit it.
"""

from __future__ import annotations

import tomllib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .spec import EXPECTATIONS_FILE, SpecError

Cell = str | bool | int | float | None
Observation = Mapping[str, Any]
# arch -> scenario -> observed fields
Observations = Mapping[str, Mapping[str, Observation]]

NULL = "null"
RAISES = "raises:"
# "warns:<substring>": exactly one of the WARNING records in a `log.warnings` cell
# (child.py joins them with LOG_SEP) holds the substring: a fallback warns once.
WARNS = "warns:"
LOG_SEP = " | "
MISSING = "<missing>"
# Observed values that say the harness could not see the decision: a probe whose
# gate the release does not offer ("unavailable:<why>", child_probes.py) or a
# harness crash in a scenario ("harness: <traceback>", child.py). They never count
# as the difference that shows a patch row bites on a pristine tree.
UNAVAILABLE = "unavailable:"
HARNESS_ERROR = "harness:"
_ROW_KEYS = {"scenario", "field", "gate", "patch", "note"}


@dataclass(frozen=True)
class Raised:
    """An observed exception: ``"<Type>: <first line of its message>"``."""

    message: str


@dataclass(frozen=True)
class Row:
    """One (scenario, field) row: the expected value on every architecture."""

    number: int  # 1-based position in the file, for messages
    scenario: str
    field: str
    gate: int | None
    patch: str | None
    cells: Mapping[str, Cell]
    note: str = ""

    @property
    def label(self) -> str:
        return f"row {self.number} {self.scenario}:{self.field}"


@dataclass(frozen=True)
class Table:
    rows: tuple[Row, ...]
    untested: Mapping[str, str]  # patch name -> why no row tests it


@dataclass(frozen=True)
class CellResult:
    arch: str
    expected: Cell
    observed: Cell | Raised
    ok: bool

    @property
    def blind(self) -> bool:
        """The cell differs because the decision could not be observed at all."""
        return not self.ok and unobservable(self.observed)

    def describe(self) -> str:
        return f"{self.arch}: expected {render(self.expected)}, observed {render(self.observed)}"


def unobservable(observed: Cell | Raised) -> bool:
    if isinstance(observed, Raised):
        return observed.message.startswith(HARNESS_ERROR)
    return isinstance(observed, str) and observed.startswith(UNAVAILABLE)


def load_table(archs: Sequence[str], path: Path = EXPECTATIONS_FILE) -> Table:
    """Read, parse and validate the table file."""
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise SpecError(f"{path}: {exc}") from exc
    return parse_table(text, archs, str(path))


def parse_table(text: str, archs: Sequence[str], source: str) -> Table:
    """The one parser of expectations.toml (the harness, the review and `explain` use
    it); every problem found is reported at once."""
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise SpecError(f"{source}: {exc}") from exc
    problems: list[str] = []
    rows: list[Row] = []
    seen: dict[tuple[str, str], int] = {}
    for number, raw in enumerate(data.get("row", []), start=1):
        unknown = set(raw) - _ROW_KEYS - set(archs)
        missing = ({"scenario", "field"} | set(archs)) - set(raw)
        if unknown:
            problems.append(f"row {number}: unknown keys {', '.join(sorted(unknown))}")
        if missing:
            problems.append(f"row {number}: missing keys {', '.join(sorted(missing))}")
        if unknown or missing:
            continue
        key = (str(raw["scenario"]), str(raw["field"]))
        if key in seen:
            problems.append(f"row {number}: duplicates row {seen[key]} ({key[0]}:{key[1]})")
        seen[key] = number
        rows.append(
            Row(
                number=number,
                scenario=key[0],
                field=key[1],
                gate=raw.get("gate"),
                patch=raw.get("patch"),
                cells={arch: raw[arch] for arch in archs},
                note=str(raw.get("note", "")),
            )
        )
    untested = {str(u["patch"]): str(u.get("reason", "")) for u in data.get("untested", [])}
    if problems:
        raise SpecError(f"{source}:\n  " + "\n  ".join(problems))
    return Table(tuple(rows), untested)


def observed_cell(observation: Observation | None, field: str) -> Cell | Raised:
    """The value a scenario's observation gives for ``field`` on one architecture."""
    if observation is None:
        return MISSING
    error = observation.get("error")
    if field == "error":
        return Raised(str(error)) if error else None
    if error:
        return Raised(str(error))
    if field not in observation:
        # ServerArgs left an SGLANG_* variable alone: the row's null.
        return None if field.startswith("env.") else MISSING
    value = observation[field]
    if isinstance(value, dict) and "raises" in value:
        return Raised(str(value["raises"]))
    if value is None or isinstance(value, str | bool | int | float):
        return value
    return str(value)


def matches(expected: Cell, observed: Cell | Raised) -> bool:
    if isinstance(expected, str) and expected.startswith(RAISES):
        return isinstance(observed, Raised) and expected[len(RAISES) :].strip() in observed.message
    if isinstance(observed, Raised):
        return False
    if isinstance(expected, str) and expected.startswith(WARNS):
        wanted = expected[len(WARNS) :].strip()
        records = observed.split(LOG_SEP) if isinstance(observed, str) else []
        return sum(wanted in record for record in records) == 1
    if expected == NULL:
        return observed is None
    return type(expected) is type(observed) and expected == observed


def render(value: Cell | Raised) -> str:
    """A cell as it would be written in expectations.toml."""
    if isinstance(value, Raised):
        value = RAISES + value.message
    if value is None:
        return f'"{NULL}"'
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return str(value)
    escaped = value.replace("\\", "\\\\").replace('"', '\\"')
    return f'"{escaped}"'


def check_row(row: Row, observations: Observations) -> list[CellResult]:
    results = []
    for arch, expected in row.cells.items():
        observed = observed_cell(observations.get(arch, {}).get(row.scenario), row.field)
        results.append(CellResult(arch, expected, observed, matches(expected, observed)))
    return results


def row_problem(row: Row, cells: Sequence[CellResult], pristine: bool) -> str | None:
    """Why one row's cells on one tree break the table's rule, or None.

    No cell may be blind, on any tree. On a pristine tree a row naming a patch must
    differ somewhere (else it tests nothing); every other row must match.
    """
    blind = [c for c in cells if c.blind]
    if blind:
        return (
            "the harness cannot observe this field (a probe found no equivalent gate, "
            "or the scenario crashed in the harness): " + "; ".join(c.describe() for c in blind)
        )
    differing = [c for c in cells if not c.ok]
    if pristine and row.patch:
        if differing:
            return None
        return (
            f"names patch {row.patch} but pristine sglang already matches every cell: "
            "this row does not test the patch"
        )
    return "; ".join(c.describe() for c in differing) or None


def toml_row(
    scenario: str,
    field: str,
    observations: Observations,
    archs: Sequence[str],
    gate: int | None = None,
) -> str:
    """A ``[[row]]`` block holding what was observed (used to fill the table)."""
    lines = ["[[row]]", f'scenario = "{scenario}"', f'field = "{field}"']
    if gate is not None:
        lines.append(f"gate = {gate}")
    for arch in archs:
        cell = observed_cell(observations.get(arch, {}).get(scenario), field)
        lines.append(f"{arch} = {render(cell)}")
    return "\n".join(lines) + "\n"
