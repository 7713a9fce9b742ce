"""report.md stays usable as a pull-request body (GitHub: at most 65536 characters)."""

from __future__ import annotations

from sm120fork.gates.diff import GateDiff
from sm120fork.gates.model import Gate
from sm120fork.rebase.report import PatchEntry, Report
from sm120fork.rebase.report_md import BODY_LIMIT, markdown


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
