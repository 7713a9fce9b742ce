"""What a gate's condition answers on one architecture: yes, no, depends, raises.

`word` is how the reports name an answer; `to_json` / `from_json` are its
form in gates.json and the reports (docs/contract.md): `true`, `false`,
`"depends: a, b"` (the non-architecture inputs it still depends on) or
`"raises KeyError in TABLE[major]"` (evaluating it fails there).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Word = Literal["yes", "no", "depends", "raises"]

_DEPENDS = "depends: "
_RAISES = "raises "


@dataclass(frozen=True)
class Answer:
    word: Word
    detail: str = ""  # depends: what on, as source text; raises: what fails

    @staticmethod
    def of(value: bool) -> Answer:
        return YES if value else NO

    @staticmethod
    def depends(on: str) -> Answer:
        return Answer("depends", on)

    @staticmethod
    def raises(what: str) -> Answer:
        return Answer("raises", what)

    def to_json(self) -> bool | str:
        if self.word == "depends":
            return _DEPENDS + self.detail
        if self.word == "raises":
            return _RAISES + self.detail
        return self.word == "yes"

    @staticmethod
    def from_json(value: object) -> Answer:
        """Read back `to_json()`."""
        if isinstance(value, bool):
            return Answer.of(value)
        if isinstance(value, str):
            for prefix, make in ((_DEPENDS, Answer.depends), (_RAISES, Answer.raises)):
                if value.startswith(prefix):
                    return make(value[len(prefix) :])
        raise ValueError(f"not a gate answer: {value!r}")


YES = Answer("yes")
NO = Answer("no")


def word(answer: Answer | None) -> Word:
    """The answer's word; none at all (an architecture not evaluated) reads as depends."""
    return "depends" if answer is None else answer.word
