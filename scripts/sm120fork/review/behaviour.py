"""Rows of the expectation table (gatetable/expectations.toml) from BASE to HEAD.

A row is what sglang decides in one scenario for one field on each
architecture; rows are matched by (scenario, field). A row whose `patch` is
not in HEAD's series tests a patch that is gone.
"""

from __future__ import annotations

from typing import Any

from sm120fork.errors import FatalError
from sm120fork.gates.model import ARCHS
from sm120fork.harness.spec import SpecError
from sm120fork.harness.table import parse_table
from sm120fork.review.model import BehaviourReview, Row, RowChange

ARCH_NAMES = tuple(arch.name for arch in ARCHS)
OTHER_ARCHS = ARCH_NAMES[:5]  # sm80 .. sm103: a patch for SM12x must not move these


def _shown(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


def parse(text: str | None, source: str) -> dict[tuple[str, str], tuple[Row, dict[str, Any]]]:
    """(scenario, field) -> the row, and its raw cell values (to compare)."""
    if text is None:
        return {}
    try:
        table = parse_table(text, ARCH_NAMES, source)
    except SpecError as error:
        raise FatalError(f"{error}; fix it there") from error
    rows: dict[tuple[str, str], tuple[Row, dict[str, Any]]] = {}
    for found in table.rows:
        raw = dict(found.cells)
        row = Row(
            scenario=found.scenario,
            field=found.field,
            patch=found.patch,
            note=found.note or None,
            cells=tuple((arch, _shown(value)) for arch, value in raw.items()),
        )
        rows[row.key] = (row, raw)
    return rows


def review_behaviour(
    old_text: str | None, new_text: str | None, series: tuple[str, ...], source: str
) -> BehaviourReview:
    old = parse(old_text, f"{source} at BASE")
    new = parse(new_text, f"{source} at HEAD")
    changed = []
    for key, (row, raw) in new.items():
        if key not in old:
            continue
        before, before_raw = old[key]
        archs = tuple(
            a
            for a in ARCH_NAMES
            if (a in raw) != (a in before_raw) or _typed(raw.get(a)) != _typed(before_raw.get(a))
        )
        if archs or before.patch != row.patch:
            changed.append(RowChange(before, row, archs))
    return BehaviourReview(
        added=tuple(row for key, (row, _) in new.items() if key not in old),
        removed=tuple(row for key, (row, _) in old.items() if key not in new),
        changed=tuple(changed),
        orphaned=tuple(row for row, _ in new.values() if row.patch and row.patch not in series),
    )


def _typed(value: Any) -> tuple[str, Any]:
    """A cell compared with its type: `true` and "true" differ."""
    return (type(value).__name__, value)
