"""The Base section: vendor/sglang.lock changed, so the PR is (or contains) a rebase.

The rebase report is looked for where a maintainer keeps it, HEAD's
`docs/rebases/<old>-to-<new>/report.json`, then in `build/rebase/report.json`
of the work tree when it names the same two releases.
"""

from __future__ import annotations

import json
from pathlib import Path

from sm120fork.jsondata import JsonObject
from sm120fork.paths import RepoPaths
from sm120fork.rebase import gatefindings
from sm120fork.rebase.report import Report
from sm120fork.review.model import UpstreamReview
from sm120fork.review.revs import read_text
from sm120fork.review.side import Side

REPORTS = "docs/rebases"


def _report(
    root: Path, head: Side, old: str | None, new: str | None
) -> tuple[str, JsonObject] | None:
    committed = f"{REPORTS}/{old}-to-{new}/report.json"
    text = read_text(root, head.rev, committed)
    where = committed
    if text is None:
        built = RepoPaths(root).rebase_dir / "report.json"
        text = built.read_text(encoding="utf-8") if built.is_file() else None
        where = built.relative_to(root).as_posix()
    if text is None:
        return None
    try:
        report = json.loads(text)
    except json.JSONDecodeError:
        return None
    if not isinstance(report, dict) or (report.get("from"), report.get("to")) != (old, new):
        return None
    return where, report


_DAMAGED = (KeyError, TypeError, ValueError, AttributeError)


def _summary(data: JsonObject) -> tuple[str, ...]:
    try:
        report = Report.from_json(data)
    except _DAMAGED:
        try:  # gates it cannot read back: the summary line alone
            return (Report.from_json({**data, "gates": {}}).summary_line(),)
        except _DAMAGED:
            return ()
    gates = report.gates
    lines = [report.summary_line(), "Gates: " + gatefindings.summary(gates) + "."]
    lines += [f"SM12x answer changed: {line}" for line in gatefindings.sm12x_changes(gates)]
    return tuple(lines)


def review_upstream(root: Path, base: Side, head: Side) -> UpstreamReview | None:
    """None when vendor/ and its lock are the same on both sides."""
    if base.lock == head.lock and base.vendor == head.vendor:
        return None
    old, new = base.version, head.version
    found = _report(root, head, old, new)
    return UpstreamReview(
        old=old,
        new=new,
        old_from=base.lock.tree_from if base.lock else None,
        new_from=head.lock.tree_from if head.lock else None,
        report=found[0] if found else None,
        summary=_summary(found[1]) if found else (),
    )
