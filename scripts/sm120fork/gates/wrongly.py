"""Wrongly included: a gate that lets SM12x into code for kernels it lacks.

For sm120 and sm121 the gate's answer says which code runs there: the true
branch when the condition is true (or depends on something else), the false
branch when it is false. A true branch that only raises is a refusal, not an
inclusion; a guard clause (`if not is_blackwell_supported(): raise`) that
SM12x passes lets it into what the surrounding code selects (the enclosing
`if`, the error message). If that code names one of the policy's tokens
(`trtllm`, `deep_gemm`, `flashmla`, ...), the gate is flagged with the token.
"""

from __future__ import annotations

from collections.abc import Sequence

from sm120fork.gates.answer import NO, YES
from sm120fork.gates.model import SM12X, Gate


def taken_words(gate: Gate, arch: str) -> tuple[str, ...]:
    """The words of the code `arch` runs because of this gate.

    False: the false branch. True: the true branch, unless it only refuses.
    Depends (on something other than the architecture): the true branch, or
    for a guard clause what passing it leads to (the architecture lets it
    through; whatever else it depends on may too).
    """
    answer = gate.archs.get(arch)
    guarded = gate.guarded
    if answer is not None and answer.word == "raises":
        return ()  # neither branch runs: the condition itself fails there
    if answer == NO:
        return guarded.taken_false or ()
    if guarded.rejects:
        # passing for sure: what the refusal names is what is let through;
        # passing maybe: only the surroundings say what (the refused case may
        # be the very thing the other inputs select, `backend == "fa3" and ...`)
        return guarded.context if answer != YES else ()
    return guarded.taken_true or ()


def check_wrongly_included(gate: Gate, tokens: Sequence[str]) -> str | None:
    """The first token named by code SM12x reaches through this gate, if any."""
    if not tokens:
        return None
    for arch in SM12X:
        words = taken_words(gate, arch)
        if not words:
            continue
        for token in tokens:
            if any(token in word for word in words):
                return token
    return None
