"""What a patch's own gate-table rows say about it at a new release (for verify.py).

Pure judgement over observations already made: the pristine new release, the
patched new release (the series carried onto it) and, for refusals, the pristine
release before. Only the SM12x cells speak for a patch; on every other
architecture the patched release must give exactly what the pristine one does,
unless the row's cell there records the patch's own change (a refusal of an
SM12x-only flag elsewhere) and the patched release meets it.

- `upstreamed`: the pristine release already gives every SM12x cell (a cell that
  expects the patch's own refusal is met by upstream refusing at the same point
  in its own words).
- after the carry, `verified`; or a stop: `dead code` (the patch applies but no
  cell differs from the pristine release, and the rows fail), `rows fail`, `other
  architectures change`, or `review` (a refusal the patch makes, whose case the
  pristine release now resolves differently than the release before did).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

from sm120fork.harness import table
from sm120fork.patches.patchfile import PatchFile
from sm120fork.rebase.gaterows import Observations, cells

_LITERAL = re.compile(r"""(["'])((?:\\.|(?!\1).)*)\1""")
_SHOWN = 3  # cells quoted in a reason

_NOT_LOADED = ("ImportError:", "ModuleNotFoundError:")


@dataclass(frozen=True)
class Verdict:
    ok: bool
    reason: str  # one clause: what the rows showed
    kind: str = ""  # for a stop: "dead code", "rows fail", "other architectures", "review"


def _more(count: int) -> str:
    return f" and {count - _SHOWN} more" if count > _SHOWN else ""


def _labels(rows: Sequence[table.Row]) -> str:
    return ", ".join(r.label for r in rows[:_SHOWN]) + _more(len(rows))


def added_text(patch: PatchFile) -> str:
    """The lines the patch adds, then their string literals joined as Python joins
    adjacent literals (a message split over lines reads whole)."""
    lines = [
        line.text
        for diff in patch.files
        for hunk in diff.hunks
        for line in hunk.lines
        if line.tag == "+"
    ]
    literals = "".join(m.group(2) for line in lines for m in _LITERAL.finditer(line))
    return "\n".join(lines) + "\n" + literals


def own_refusal(cell: table.CellResult, added: str) -> bool:
    """A cell expecting the patch's own refusal, met by the release refusing otherwise.
    The words are the patch's when its added lines hold them, or hold what follows
    their first `: ` (a prefix the patch formats at run time)."""
    expected = cell.expected
    if not isinstance(expected, str) or not expected.startswith(table.RAISES):
        return False
    if not isinstance(cell.observed, table.Raised) or cell.blind:
        return False
    words = expected[len(table.RAISES) :].strip()
    tail = words.partition(": ")[2]
    return words in added or (len(tail) >= 20 and tail in added)


def upstreamed(
    version: str,
    rows: Sequence[table.Row],
    pristine: Observations,
    sm12x: Sequence[str],
    added: str,
) -> Verdict:
    """Whether the pristine release already gives every SM12x cell of `rows`."""
    judged = [c for row in rows for c in cells(row, pristine, sm12x)]
    if not judged or any(not c.ok and not own_refusal(c, added) for c in judged):
        return Verdict(False, "")
    words = sorted({table.render(c.observed) for c in judged if not c.ok})
    refusal = f"; it refuses where the patch does, in its own words ({words[0]})" if words else ""
    return Verdict(
        True,
        f"upstream {version} already gives {'/'.join(sm12x)} what the patch's own rows "
        f"expect ({_labels(rows)}, run on the pristine release){refusal}",
    )


def after_carry(
    version: str,
    rows: Sequence[table.Row],
    observed: tuple[Observations, Observations, Observations | None],
    sm12x: Sequence[str],
    others: Sequence[str],
) -> Verdict:
    """The patch's rows on the patched release: `observed` is (pristine, patched, the
    pristine release before, or None where it was not observed)."""
    pristine, patched, before = observed
    failing = [(row, c) for row in rows for c in cells(row, patched, sm12x) if not c.ok]
    if failing:
        same = all(_value(pristine, row, c.arch) == table.render(c.observed) for row, c in failing)
        shown = "; ".join(
            f"{row.label} {c.arch}: expected {table.render(c.expected)}, "
            f"patched {table.render(c.observed)}"
            for row, c in failing[:_SHOWN]
        )
        if same:
            return Verdict(
                False,
                f"dead code on {version}: it applies, but its rows fail and the patched "
                f"release gives what the pristine one does ({shown}{_more(len(failing))})",
                "dead code",
            )
        return Verdict(
            False, f"its rows fail on patched {version} ({shown}{_more(len(failing))})", "rows fail"
        )
    changed = [
        (row, arch)
        for row in rows
        for arch in others
        if _value(patched, row, arch) != _value(pristine, row, arch)
        and not all(c.ok for c in cells(row, patched, [arch]))  # not the table's own change
    ]
    if changed:
        shown = "; ".join(
            f"{row.label} {arch}: upstream {_value(pristine, row, arch)}, "
            f"patched {_value(patched, row, arch)}"
            for row, arch in changed[:_SHOWN]
        )
        return Verdict(
            False,
            f"it changes what other architectures get on {version} ({shown}"
            f"{_more(len(changed))}); they must stay as upstream's",
            "other architectures",
        )
    moved = _refusals_moved(rows, pristine, before, sm12x) if before is not None else []
    if moved:
        return Verdict(
            False,
            f"it still refuses where upstream {version} now resolves the case otherwise "
            f"({'; '.join(moved[:_SHOWN])}{_more(len(moved))}): a person decides whether "
            "the refusal still holds",
            "review",
        )
    archs = "/".join(sm12x)
    return Verdict(
        True,
        f"verified: its rows pass on patched {version} ({_labels(rows)} on {archs}), "
        "the other architectures as upstream's",
    )


def _refusals_moved(
    rows: Sequence[table.Row], pristine: Observations, before: Observations, sm12x: Sequence[str]
) -> list[str]:
    """The refusal cells whose pristine resolution changed since the release before."""
    moved = []
    for row in rows:
        for arch in sm12x:
            expected = row.cells.get(arch)
            if not (isinstance(expected, str) and expected.startswith(table.RAISES)):
                continue
            now, then = _resolution(pristine, row, arch), _resolution(before, row, arch)
            if now is not None and then is not None and now != then:
                moved.append(f"{row.label} {arch}: upstream now {now}, before {then}")
    return moved


def _value(observations: Observations, row: table.Row, arch: str) -> str:
    scenario = observations.get(arch, {}).get(row.scenario)
    return table.render(table.observed_cell(scenario, row.field))


def _resolution(observations: Observations, row: table.Row, arch: str) -> str | None:
    """How a release resolves the cell's case: "a refusal" for any error (its words may
    change freely), else the value; None where it cannot be seen (an import that fails
    says the tree does not fit the environment, not how the case is resolved)."""
    observed = table.observed_cell(observations.get(arch, {}).get(row.scenario), row.field)
    if table.unobservable(observed) or observed == table.MISSING:
        return None
    if isinstance(observed, table.Raised) and observed.message.startswith(_NOT_LOADED):
        return None
    return "a refusal" if isinstance(observed, table.Raised) else table.render(observed)
