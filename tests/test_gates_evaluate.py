"""Evaluating a condition per architecture: true, false or depends (three-valued)."""

from __future__ import annotations

import itertools
import textwrap
from collections.abc import Callable

from hypothesis import assume, given, settings
from hypothesis import strategies as st
from sm120fork.gates.model import ARCHS, Arch
from sm120fork.gates.scan import scan_source
from test_gates_support import answers

PRELUDE = """
import torch
from sglang.srt.utils import (
    get_device_sm, is_blackwell_supported, is_cuda, is_hip, is_sm90_supported,
    is_sm100_supported, is_sm120_supported,
)

_is_cuda = is_cuda()
_is_hip = is_hip()

def f(foo, bar):
    major, minor = torch.cuda.get_device_capability()
    sm = get_device_sm()
    if {condition}:
        pass
"""


def evaluate(condition: str) -> dict[str, bool | str]:
    gates = scan_source(textwrap.dedent(PRELUDE).format(condition=condition))
    found = [g for g in gates if g.function == "f"]
    assert len(found) == 1, [g.condition for g in gates]
    return {arch: answer.to_json() for arch, answer in found[0].archs.items()}


def test_three_valued_and_or_not() -> None:
    archs = evaluate("is_sm100_supported() and foo")
    assert archs["sm90"] is False
    assert archs["sm100"] == "depends: foo"
    archs = evaluate("is_sm100_supported() or foo")
    assert archs["sm100"] is True
    assert archs["sm120"] == "depends: foo"
    archs = evaluate("not (is_blackwell_supported() and bar)")
    assert archs["sm89"] is True
    assert archs["sm121"] == "depends: bar"
    archs = evaluate("foo and bar and sm >= 100")
    assert archs["sm90"] is False
    assert archs["sm103"] == "depends: bar, foo"


def test_platform_probes_are_known_on_cuda() -> None:
    assert evaluate("_is_cuda and is_sm90_supported()")["sm90"] is True
    assert evaluate("_is_hip or sm >= 120")["sm100"] is False
    assert set(evaluate("_is_hip and sm >= 90").values()) == {False}


def test_minor_versions_count() -> None:
    gates = scan_source(textwrap.dedent(PRELUDE).format(condition="major == 10 and minor == 3"))
    assert answers(gates[-1]) == "FFFFTFF"
    gates = scan_source(textwrap.dedent(PRELUDE).format(condition="sm in (120, 121)"))
    assert answers(gates[-1]) == "FFFFFTT"


# -- a property: whatever is known agrees with Python on every input --------

HELPER_MEANING: dict[str, Callable[[Arch], bool]] = {
    "is_sm90_supported()": lambda a: a.major == 9,
    "is_sm100_supported()": lambda a: a.major == 10,
    "is_sm120_supported()": lambda a: a.major == 12,
    "is_blackwell_supported()": lambda a: a.major in (10, 11, 12),
}
ATOMS = [
    *HELPER_MEANING,
    *(f"sm >= {n}" for n in (80, 89, 90, 100, 103, 120, 121)),
    *(f"major == {n}" for n in (8, 9, 10, 12)),
    "major in (10, 12)",
    "90 <= sm < 120",
    "foo",
    "bar",
]

conditions = st.recursive(
    st.sampled_from(ATOMS),
    lambda inner: st.one_of(
        st.builds(lambda x: f"not ({x})", inner),
        st.builds(lambda x, y: f"({x}) and ({y})", inner, inner),
        st.builds(lambda x, y: f"({x}) or ({y})", inner, inner),
    ),
    max_leaves=5,
)


def python_answers(condition: str, arch: Arch) -> set[bool]:
    """What Python gives on `arch` for every value of the unknowns foo and bar."""
    expression = condition
    for call, meaning in HELPER_MEANING.items():
        expression = expression.replace(call, str(meaning(arch)))
    results = set()
    for foo, bar in itertools.product((True, False), repeat=2):
        names = {"foo": foo, "bar": bar, "sm": arch.sm, "major": arch.major, "minor": arch.minor}
        results.add(bool(eval(expression, {}, names)))  # our own generated text
    return results


@settings(max_examples=150, deadline=None)
@given(conditions)
def test_known_answers_agree_with_python(condition: str) -> None:
    assume(any(atom in condition for atom in ATOMS[:-2]))  # foo / bar alone: no gate
    archs = evaluate(condition)
    for arch in ARCHS:
        answer, possible = archs[arch.name], python_answers(condition, arch)
        if isinstance(answer, bool):
            assert possible == {answer}, (condition, arch.name)
        else:
            assert answer.startswith("depends: ")
        if "foo" not in condition and "bar" not in condition:
            assert isinstance(answer, bool), (condition, arch.name, answer)
