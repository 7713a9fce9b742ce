"""The strategies past a plain 3-way merge, each on the smallest upstream change that needs
it (carry.STRATEGIES): relocation, the rules that resolve a conflict, the platform helper,
and the conflicts no rule may decide."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest
from forkrepo import make_patch
from rebasefork import BASE, COMM, SA, RebaseFork, edited, make_rebase_fork
from sm120fork.gates.semantics import HELPER_FACTS as FACTS
from sm120fork.patches.patchfile import PatchFile, parse_patch
from sm120fork.rebase import strategy
from sm120fork.rebase.resolutions import resolve_block

OVERRIDES = "python/sglang/srt/arg_groups/overrides.py"


def _carry(
    request: pytest.FixtureRequest,
    v10: dict[str, str],
    series: list[tuple[str, list[tuple[str, str, str]]]],
    v9: dict[str, str] = BASE,
) -> tuple[RebaseFork, dict[str, Any]]:
    fork = make_rebase_fork(request, {"v0.5.9": v9, "v0.5.10": v10}, series)
    result = fork.rebase("v0.5.10")
    [patch] = fork.report()["patches"]
    assert result.returncode == (1 if patch["status"] == "conflict" else 0), result.stderr
    return fork, patch


def test_upstream_changing_the_line_below_the_patchs_is_an_adjacent_edit(
    request: pytest.FixtureRequest,
) -> None:
    v10 = edited(BASE, (SA, "x_26 = 26\n", "x_26 = 'upstream'\n"))
    fork, patch = _carry(request, v10, [("0001-a.patch", [(SA, "x_25 = 25\n", "x_25 = 'f'\n")])])
    assert (patch["status"], patch["strategy"]) == ("merged", "adjacent-edits")
    assert "upstream changed lines next to the patch's" in patch["detail"]
    text = fork.read("patches/0001-a.patch")
    assert "+x_25 = 'f'\n x_26 = 'upstream'\n" in text


def test_upstream_changing_the_condition_the_patch_sits_under_is_a_judgement(
    request: pytest.FixtureRequest,
) -> None:
    v9 = edited(BASE, (SA, "x_24 = 24\n", "if ready():\n"), (SA, "x_25 = 25\n", "    x = 1\n"))
    v10 = edited(v9, (SA, "if ready():\n", "if ready() and other():\n"))
    series = [("0001-a.patch", [(SA, "    x = 1\n", "    guard()\n    x = 1\n")])]
    _, patch = _carry(request, v10, series, v9)
    assert patch["status"] == "conflict"
    assert (
        "a judgement, not a rule: in server_args.py, 1 block where upstream changed a line "
        "that opens a block or tests the architecture, next to the patch's"
    ) in patch["detail"]


def test_a_docstring_rewritten_to_fewer_lines_above_the_patch(
    request: pytest.FixtureRequest,
) -> None:
    doc = '    """Validate for TRTLLM\n    and tokenspeed MLA backends.\n    """\n'
    v9 = edited(BASE, (SA, "x_20 = 20\n", "def checks():\n" + doc + "    x = 1\n"))
    v10 = edited(v9, (SA, doc, '    """Validate for the TRTLLM MLA backend."""\n'))
    series = [("0001-a.patch", [(SA, '    """\n    x = 1\n', '    """\n    guard()\n    x = 1\n')])]
    fork, patch = _carry(request, v10, series, v9)
    assert (patch["status"], patch["strategy"]) == ("merged", "docstring")
    text = fork.read("patches/0001-a.patch")
    assert ' """Validate for the TRTLLM MLA backend."""\n+    guard()\n' in text


def test_both_sides_changing_one_parenthesized_import_list(
    request: pytest.FixtureRequest,
) -> None:
    # 0.5.19: upstream dropped the name beside the one the patch adds.
    imports = "from m import (\n    a,\n    is_sm100_supported,\n)\n"
    v9 = edited(BASE, (SA, "x_1 = 1\n", imports))
    v10 = edited(v9, (SA, "    is_sm100_supported,\n", "    get_platform,\n"))
    edit = (SA, "    is_sm100_supported,\n", "    is_sm100_supported,\n    is_sm120,\n")
    fork, patch = _carry(request, v10, [("0001-a.patch", [edit])], v9)
    assert (patch["status"], patch["strategy"]) == ("merged", "import-list")
    text = fork.read("patches/0001-a.patch")
    assert "-    is_sm100_supported," not in text  # upstream's removal is not the patch's
    assert "     get_platform,\n+    is_sm120,\n )\n" in text


def test_two_insertions_at_one_point_keep_upstreams_first_by_rule(
    request: pytest.FixtureRequest,
) -> None:
    v10 = edited(BASE, (SA, "x_30 = 30\n", "x_30 = 30\nupstream_rule()\n"))
    series = [("0001-a.patch", [(SA, "x_30 = 30\n", "x_30 = 30\nsm120_rule()\n")])]
    fork, patch = _carry(request, v10, series)
    assert (patch["status"], patch["strategy"]) == ("merged", "two-insertions")
    assert "an order chosen by rule" in patch["detail"]
    assert " upstream_rule()\n+sm120_rule()\n" in fork.read("patches/0001-a.patch")
    changelog = fork.read("CHANGELOG.md")
    assert "[strategy: two-insertions]." in changelog


def test_a_file_upstream_deleted_takes_the_patchs_hunks_with_it(
    request: pytest.FixtureRequest,
) -> None:
    # 0.5.11: sm_scale changed on the line below, and the double-sparsity kernel went.
    v10 = edited(BASE, (SA, "x_26 = 26\n", "x_26 = 'upstream'\n"))
    del v10[COMM]
    edits = [(SA, "x_25 = 25\n", "x_25 = 'f'\n"), (COMM, "c_5 = 5\n", "c_5 = 'f'\n")]
    fork, patch = _carry(request, v10, [("0001-a.patch", edits)])
    assert (patch["status"], patch["strategy"]) == ("merged", "adjacent-edits+deleted-file")
    assert (
        "upstream deleted communicator.py (the patch's hunks there go with it)" in (patch["detail"])
    )
    text = fork.read("patches/0001-a.patch")
    assert COMM not in text and "+x_25 = 'f'" in text


def test_a_patch_whose_only_file_upstream_deleted_is_a_judgement(
    request: pytest.FixtureRequest,
) -> None:
    v10 = dict(BASE)
    del v10[COMM]
    _, patch = _carry(request, v10, [("0001-a.patch", [(COMM, "c_5 = 5\n", "c_5 = 'f'\n")])])
    assert patch["status"] == "conflict"
    assert (
        "upstream deleted communicator.py, and nothing else of the patch is left"
        in (patch["detail"])
    )


METHOD = "".join(f"        v_{i} = {i}\n" for i in range(1, 8))
MOVED = "".join(f"    v_{i} = {i}\n" for i in range(1, 8))


def test_code_that_left_its_file_is_re_applied_where_it_went(
    request: pytest.FixtureRequest,
) -> None:
    # 0.5.15: a ServerArgs method became a function of arg_groups/overrides.py.
    v9 = edited(BASE, (SA, "x_70 = 70\n", "class ServerArgs:\n    def _moe(self):\n" + METHOD))
    v10 = edited(v9, (SA, "class ServerArgs:\n    def _moe(self):\n" + METHOD, "x_70 = 70\n"))
    v10[OVERRIDES] = "def _moe(args):\n" + MOVED
    series = [("0001-a.patch", [(SA, "        v_4 = 4\n", "        v_4 = 'sm120'\n")])]
    fork, patch = _carry(request, v10, series, v9)
    assert (patch["status"], patch["strategy"]) == ("merged", "relocate"), patch["detail"]
    assert "server_args.py -> overrides.py:2 (re-indented -4)" in patch["detail"]
    text = fork.read("patches/0001-a.patch")
    assert f"+++ b/{OVERRIDES}" in text and "+    v_4 = 'sm120'\n" in text and SA not in text


def test_lines_edited_at_home_and_copied_elsewhere_are_no_move(
    request: pytest.FixtureRequest,
) -> None:
    v9 = edited(BASE, (SA, "x_70 = 70\n", "class ServerArgs:\n    def _moe(self):\n" + METHOD))
    v10 = edited(v9, (SA, "        v_3 = 3\n", "        v_3 = 'upstream'\n"))
    v10[OVERRIDES] = "def _moe(args):\n" + MOVED  # a new copy; the original stays
    series = [("0001-a.patch", [(SA, "        v_4 = 4\n", "        v_4 = 'sm120'\n")])]
    fork, patch = _carry(request, v10, series, v9)
    assert (patch["status"], patch["strategy"]) == ("merged", "adjacent-edits")
    assert OVERRIDES not in fork.read("patches/0001-a.patch")


def test_lines_that_were_in_another_file_all_along_are_no_move(
    request: pytest.FixtureRequest,
) -> None:
    v9 = edited(BASE, (SA, "x_70 = 70\n", "class ServerArgs:\n    def _moe(self):\n" + METHOD))
    v9[OVERRIDES] = "def _moe(args):\n" + MOVED  # a copy, there before the release
    v10 = edited(v9, (SA, "class ServerArgs:\n    def _moe(self):\n" + METHOD, "x_70 = 70\n"))
    series = [("0001-a.patch", [(SA, "        v_4 = 4\n", "        v_4 = 'sm120'\n")])]
    _, patch = _carry(request, v10, series, v9)
    assert patch["status"] == "conflict"


def test_a_removed_helper_is_rewritten_to_the_platform_object(
    request: pytest.FixtureRequest,
) -> None:
    # 0.5.21: overrides.py stopped importing is_sm120_supported and uses get_platform().
    v9 = edited(BASE, (SA, "x_1 = 1\n", "from u import is_sm120_supported\n"))
    v10 = edited(v9, (SA, "from u import is_sm120_supported\n", "from p import get_platform\n"))
    series = [("0001-a.patch", [(SA, "x_25 = 25\n", "x_25 = is_sm120_supported()\n")])]
    fork, patch = _carry(request, v10, series, v9)
    assert (patch["status"], patch["strategy"]) == ("merged", "exact+platform-helper")
    assert "is_sm120_supported() -> get_platform().is_sm120" in patch["detail"]
    assert "+x_25 = get_platform().is_sm120\n" in fork.read("patches/0001-a.patch")


def test_a_removed_helper_without_the_platform_object_stays_a_conflict(
    request: pytest.FixtureRequest,
) -> None:
    v9 = edited(BASE, (SA, "x_1 = 1\n", "from u import is_sm120_supported\n"))
    v10 = edited(v9, (SA, "from u import is_sm120_supported\n", "x_1 = 1\n"))
    series = [("0001-a.patch", [(SA, "x_25 = 25\n", "x_25 = is_sm120_supported()\n")])]
    _, patch = _carry(request, v10, series, v9)
    assert patch["status"] == "conflict"
    assert "undefined name `is_sm120_supported`" in patch["detail"]


FUNCTION = (
    "def _olmo2(args):\n"
    "    if a():\n"
    '        r = "trtllm"\n'
    "    elif b():\n"
    '        r = "fa3"\n'
    "    return r\n"
)
OLMO2 = "python/sglang/srt/arg_groups/model_overrides/olmo2.py"


def _olmo2_moved(imports: str, function: str) -> tuple[dict[str, str], dict[str, str]]:
    """(0.5.9, 0.5.10): FUNCTION in server_args.py, then `function` in its own module."""
    v9 = edited(BASE, (SA, "x_70 = 70\n", FUNCTION))
    v10 = edited(v9, (SA, FUNCTION, "x_70 = 70\n"))
    v10[OLMO2] = f"from h import {imports}\n\n\n{function}"
    return v9, v10


def test_a_function_upstream_moved_and_edited_gets_the_patch_merged_into_it(
    request: pytest.FixtureRequest,
) -> None:
    # 0.5.19: Olmo2's override moved to its own module, and changed as it went.
    moved = FUNCTION.replace("(args):\n", "(args):\n    log()\n")
    v9, v10 = _olmo2_moved("a, b, log, sm120", moved)
    sm120 = '        r = "trtllm"\n    elif sm120():\n        r = "triton"\n'
    series = [("0001-a.patch", [(SA, '        r = "trtllm"\n', sm120)])]
    fork, patch = _carry(request, v10, series, v9)
    assert (patch["status"], patch["strategy"]) == ("merged", "relocate"), patch["detail"]
    assert "server_args.py:_olmo2() -> olmo2.py, merged 3-way" in patch["detail"]
    text = fork.read("patches/0001-a.patch")
    assert f"+++ b/{OLMO2}" in text and "+    elif sm120():\n" in text and SA not in text


def test_a_moved_function_whose_lines_the_patch_and_upstream_both_changed_is_a_judgement(
    request: pytest.FixtureRequest,
) -> None:
    # 0.5.15: the moved code returns overrides instead of setting fields.
    returned = FUNCTION.replace('r = "trtllm"', 'return {"backend": "trtllm"}')
    v9, v10 = _olmo2_moved("a, b, sm120", returned)
    sm120 = '        r = "triton" if sm120() else "trtllm"\n'
    series = [("0001-a.patch", [(SA, '        r = "trtllm"\n', sm120)])]
    _, patch = _carry(request, v10, series, v9)
    assert patch["status"] == "conflict"
    assert "a judgement, not a rule: in server_args.py, 1 block where both" in patch["detail"]


def test_the_rules_on_single_blocks() -> None:
    base = ["a = 1\n", "b = 2\n", "c = 3\n"]
    # Upstream replaces b; the patch inserts before it and after it: both kept, base order.
    assert resolve_block(
        ["a = 1\n", "B = 2\n", "c = 3\n"], base, [*base[:1], "p()\n", *base[1:]]
    ) == (
        ["a = 1\n", "p()\n", "B = 2\n", "c = 3\n"],
        "adjacent-edits",
    )
    # The patch inserts inside the lines upstream replaced: no order is safe.
    assert resolve_block(["a = 1\n", "X = 9\n"], base, [*base[:2], "p()\n", base[2]]) is None
    # Upstream rewrote a line that tests the architecture next to the patch's.
    gate = ["if is_sm100_supported(): x = 1\n", "y = 2\n"]
    theirs = [gate[0], "p()\n", gate[1]]
    assert (
        resolve_block(["if is_sm100_supported() and ok: x = 1\n", "y = 2\n"], gate, theirs) is None
    )
    # A comment re-written to more lines above the patch's change is the docstring rule's.
    note = ["# old note\n", "x = 1\n"]
    ours = ["# new note,\n", "# on two lines\n", "x = 1\n"]
    assert resolve_block(ours, note, [note[0], "x = 2\n"]) == ([*ours[:2], "x = 2\n"], "docstring")


def test_the_platform_facts_of_the_removed_helpers() -> None:
    assert FACTS["is_sm120_supported"] == "is_sm120"
    assert FACTS["is_sm100_supported"] == "is_sm100"
    assert "is_sm120" not in FACTS  # utils.is_sm120() is 12.0 only: no platform fact is


def test_a_patch_text_is_parsed_once(monkeypatch: pytest.MonkeyPatch) -> None:
    text = make_patch("a", BASE, edited(BASE, (SA, "x_2 = 2\n", "x_2 = 'f'\n")))
    loaded = parse_patch(text.encode(), "0001-a.patch", 1)  # as load_stack does
    calls: list[str] = []

    def counted(raw: bytes, name: str, strip: int = 1) -> PatchFile:
        calls.append(name)
        return parse_patch(raw, name, strip)

    monkeypatch.setattr(strategy, "parse_patch", counted)
    state = strategy.state_of(loaded)
    assert strategy.parsed(state) is loaded and calls == []  # the series' own parse
    refreshed = replace(state, text=text.replace("x_2 = 'f'", "x_2 = 'g'"))
    assert strategy.parsed(refreshed) is strategy.parsed(refreshed)
    assert calls == ["0001-a.patch"]  # a new text: parsed once
