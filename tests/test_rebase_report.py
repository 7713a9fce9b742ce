"""report.md stays usable as a pull-request body (GitHub: at most 65536 characters)."""

from __future__ import annotations

from sm120fork.rebase.report import BODY_LIMIT, markdown


def _report(gates: int) -> dict[str, object]:
    site = {"file": "python/sglang/srt/x.py", "function": "f", "condition": "is_sm100()" * 5}
    return {
        "from": "0.5.9",
        "to": "0.5.23",
        "source": "pypi",
        "result": "complete",
        "patches": [{"name": "a.patch", "status": "clean", "detail": "ok", "conflicts": []}],
        "gates": {
            "new": [{**site, "line": n} for n in range(gates)],
            "changed": [],
            "moved": [],
            "removed": [],
            "unreviewed": [],
        },
    }


def test_small_reports_list_every_gate() -> None:
    text = markdown(_report(20))
    assert "python/sglang/srt/x.py:19" in text
    assert "more in report.json" not in text


def test_a_huge_gate_list_is_shortened_to_fit_a_pull_request_body() -> None:
    text = markdown(_report(5000))
    assert len(text) <= BODY_LIMIT
    assert "<details><summary>new (5000)</summary>" in text
    assert "- ... and 4800 more in report.json" in text
