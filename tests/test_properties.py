"""Property-based tests of the parsers and of the normal form.

The parsers may reject input only with the tool's own error type, round
trips are exact, and a refresh of a refreshed patch changes nothing.
"""

from __future__ import annotations

import contextlib

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sm120fork.errors import FatalError
from sm120fork.patches import dep3
from sm120fork.patches.applier import apply_file
from sm120fork.patches.diffs import parse_diff
from sm120fork.patches.normalform import DiffRenderer, render_patch
from sm120fork.patches.patchfile import parse_patch
from sm120fork.patches.series import parse_series

names = st.from_regex(r"[a-z0-9][a-z0-9._-]{0,20}\.patch", fullmatch=True)
comments = st.from_regex(r"#[^\n\r]{0,30}", fullmatch=True)
series_lines = st.one_of(
    names,
    names.map(lambda n: f"{n} -p0"),
    names.map(lambda n: f"{n} -p1  # note"),
    comments,
    st.just(""),
)
SLOW = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@given(st.lists(series_lines, max_size=12))
def test_series_round_trip_is_exact(lines: list[str]) -> None:
    text = "".join(line + "\n" for line in lines)
    series = parse_series(text)
    assert series.render() == text
    assert not series.problems
    assert [e.name for e in series.entries] == [
        line.split()[0] for line in lines if line and not line.startswith("#")
    ]


@given(st.text(max_size=300))
def test_series_parser_never_raises(text: str) -> None:
    series = parse_series(text)
    # Rendering gives the text back, with a final newline added if it lacked one.
    assert series.render() == (text if not text or text.endswith("\n") else text + "\n")


@given(st.text(max_size=400))
def test_dep3_parser_keeps_raw_and_never_raises(text: str) -> None:
    header = dep3.parse_header(text)
    assert header.raw == text
    dep3.validate(header)


@given(st.binary(max_size=400))
def test_patch_parser_raises_only_the_tools_error(data: bytes) -> None:
    with contextlib.suppress(FatalError):  # any other exception fails the test
        parse_patch(data, "fuzz.patch")


DIFF_LINES = [
    "--- a/x.py", "+++ b/x.py", "--- /dev/null", "+++ /dev/null", "@@ -1 +1 @@",
    "@@ -1,2 +1,3 @@ f", "\\ No newline at end of file", "diff --git a/x.py b/x.py",
    "GIT binary patch", "--- a/../x", "+++ b//abs",
]  # fmt: skip
diff_like = st.lists(
    st.one_of(
        st.sampled_from(DIFF_LINES),
        st.text(alphabet=" +-@abc\\", max_size=8),
    ),
    max_size=20,
)  # fmt: skip


@given(diff_like)
def test_diff_parser_raises_only_the_tools_error(lines: list[str]) -> None:
    with contextlib.suppress(FatalError):  # any other exception fails the test
        parse_diff("\n".join(lines) + "\n")


source_lines = st.lists(
    st.sampled_from(["a\n", "b\n", "c\n", "if x:\n", "    pass\n", "\n"]), max_size=30
)


@SLOW
@given(source_lines, source_lines, st.booleans())
def test_normal_form_applies_and_refresh_is_idempotent(
    old: list[str], new: list[str], drop_final_newline: bool
) -> None:
    before_text = "".join(old)
    after_text = "".join(new)
    if drop_final_newline and after_text.endswith("\n"):
        after_text = after_text[:-1]
    path = "python/sglang/x.py"
    header = dep3.parse_header("From: A <a@example.com>\nSubject: s\n\nwhy\n")
    with DiffRenderer() as renderer:
        diff = renderer.diff({path: before_text}, {path: after_text})
        if not diff:
            assert before_text == after_text
            return
        patch = parse_patch(render_patch(header, diff), "p.patch")
        (file_diff,) = patch.files
        applied, offsets = apply_file(before_text, file_diff)
        assert applied == after_text
        assert not any(offsets)
        again = renderer.diff({path: before_text}, {path: applied})
        assert render_patch(patch.header, again) == patch.raw
