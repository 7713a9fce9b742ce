"""report.md stays usable as a pull-request body (GitHub: at most 65536 characters);
report.json reads back into the record."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
from sm120fork.gates.diff import GateDiff
from sm120fork.gates.model import Gate
from sm120fork.rebase.report import PatchEntry, Report
from sm120fork.rebase.report_md import BODY_LIMIT, markdown
from sm120fork.rebase.state import Conflict

STORED = Path(__file__).resolve().parent.parent / "docs/rebases/0.5.9-to-0.5.23/report.json"


def _report(gates: int) -> Report:
    sites = tuple(
        Gate("python/sglang/srt/x.py", n, "f", "if", "is_sm100()" * 5, {}) for n in range(gates)
    )
    return Report(
        from_version="0.5.9",
        to="0.5.23",
        source="pypi",
        result="complete",
        patches=(PatchEntry("a.patch", "clean", "ok"),),
        gates=GateDiff(new=sites, removed=(), changed=(), moved=(), unreviewed=()),
    )


def test_small_reports_list_every_gate() -> None:
    text = markdown(_report(20))
    assert "python/sglang/srt/x.py:19" in text
    assert "more in report.json" not in text


def test_a_huge_gate_list_is_shortened_to_fit_a_pull_request_body() -> None:
    text = markdown(_report(5000))
    assert len(text) <= BODY_LIMIT
    assert "<details><summary>new (5000)</summary>" in text
    assert "- ... and 4800 more in report.json" in text


def test_a_report_reads_back_from_its_json() -> None:
    conflict = Conflict("python/sglang/srt/x.py", 12, True, "if a:", "if b:", "if c:")
    report = dataclasses.replace(
        _report(3),
        result="conflict",
        patches=(
            PatchEntry("a.patch", "clean", "ok"),
            PatchEntry("b.patch", "conflict", "stopped", (conflict,)),
            PatchEntry("c.patch", "pending", ""),
        ),
        releases=("0.5.10", "0.5.23"),
        work_tree="build/rebase/work",
    )
    again = Report.from_json(json.loads(json.dumps(report.to_json())))
    assert again == report
    assert again.summary_line() == (
        "From sglang 0.5.9 to 0.5.23 (pypi): **stopped on a conflict**; "
        "1 clean, 1 conflict, 1 pending."
    )


def test_a_stored_step_report_gives_its_summary_line() -> None:
    """The committed 0.5.9 -> 0.5.23 report: its walk is left out, the rest reads back."""
    data = json.loads(STORED.read_text(encoding="utf-8"))
    report = Report.from_json(data)
    assert report.walk is None and report.releases == tuple(data["releases"])
    assert report.to_json()["gates"] == data["gates"]
    assert [p.status for p in report.patches] == [p["status"] for p in data["patches"]]
    assert report.summary_line().startswith("From sglang 0.5.9 to 0.5.23 (pypi): **complete**; ")


@pytest.mark.parametrize(
    ("damage", "error"),
    [
        ({"source": "svn"}, KeyError),
        ({"result": "maybe"}, KeyError),
        ({"to": 5}, TypeError),
        ({"patches": {}}, TypeError),
        ({"patches": [{"name": "a.patch", "status": "lost"}]}, KeyError),
    ],
)
def test_a_damaged_report_is_refused(damage: dict[str, object], error: type[Exception]) -> None:
    data = {**_report(1).to_json(), **damage}
    with pytest.raises(error):
        Report.from_json(data)
