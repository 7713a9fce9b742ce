"""A gate's answer on one architecture: its words, its JSON, and JSON read back."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from sm120fork.gates.answer import NO, YES, Answer, word
from sm120fork.gates.diff import GateDiff

OLD_REPORT = Path(__file__).resolve().parent.parent / "docs/rebases/0.5.9-to-0.5.23/report.json"


@pytest.mark.parametrize(
    ("answer", "stored", "said"),
    [
        (YES, True, "yes"),
        (NO, False, "no"),
        (Answer.depends("batch_size, foo"), "depends: batch_size, foo", "depends"),
        (Answer.raises("KeyError in BLOCKS[major]"), "raises KeyError in BLOCKS[major]", "raises"),
    ],
)
def test_answer_words_and_json(answer: Answer, stored: bool | str, said: str) -> None:
    assert answer.to_json() == stored
    assert Answer.from_json(stored) == answer
    assert word(answer) == said


def test_of_a_bool_and_no_answer_at_all() -> None:
    assert Answer.of(True) is YES
    assert Answer.of(False) is NO
    assert word(None) == "depends"  # an architecture not evaluated


@pytest.mark.parametrize("stored", ["maybe", "depends", 1, None])
def test_anything_else_is_not_an_answer(stored: object) -> None:
    with pytest.raises(ValueError, match="not a gate answer"):
        Answer.from_json(stored)


def test_a_stored_report_reads_back_byte_for_byte() -> None:
    """report.json of the 0.5.9 -> 0.5.23 rebase, written before answers had a type."""
    report = json.loads(OLD_REPORT.read_text(encoding="utf-8"))
    again = GateDiff.from_json(report["gates"]).to_json()
    assert json.dumps(again, indent=2) == json.dumps(report["gates"], indent=2)
