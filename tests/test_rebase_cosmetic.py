"""Conflicts that are only upstream re-wording a comment beside the patch (cosmetic.py)."""

from __future__ import annotations

import pytest
from rebasefork import BASE, SA, edited, make_rebase_fork
from sm120fork.rebase.resolutions import PHRASES, resolve_block, resolve_text

REWORDED, IMPORTS = "docstring", "import-list"  # the rules' names

BASE_BLOCK = ["    if nsa(cfg):  # DeepSeek 3.2, GLM\n", "        x = 1\n"]
PATCH_BLOCK = [BASE_BLOCK[0], "        guard()\n", BASE_BLOCK[1]]


def test_a_reworded_comment_keeps_upstreams_words_and_the_patchs_change() -> None:
    ours = ["    if nsa(cfg):  # DeepSeek 3.2/GLM 5\n", BASE_BLOCK[1]]
    assert resolve_block(ours, BASE_BLOCK, PATCH_BLOCK) == ([ours[0], *PATCH_BLOCK[1:]], REWORDED)


@pytest.mark.parametrize(
    "ours",
    [
        ["    if nsa(cfg) and sm100:  # DeepSeek 3.2, GLM\n", BASE_BLOCK[1]],  # code changed
        ["if nsa(cfg):  # DeepSeek 3.2, GLM\n", BASE_BLOCK[1]],  # indentation is code
    ],
)
def test_anything_but_a_comment_edit_stays_a_conflict(ours: list[str]) -> None:
    assert resolve_block(ours, BASE_BLOCK, PATCH_BLOCK) is None


def test_a_line_both_sides_changed_stays_a_conflict() -> None:
    ours = [BASE_BLOCK[0], "        x = 1  # upstream's note\n"]
    theirs = [BASE_BLOCK[0], "        x = 2\n"]  # the patch rewrites the re-worded line
    assert resolve_block(ours, BASE_BLOCK, theirs) is None


def test_a_hash_inside_a_string_is_not_a_comment() -> None:
    base = ['    s = "a # b"\n']
    ours = ['    s = "a # c"\n']
    theirs = [*base, "    guard()\n"]
    # Not a re-worded comment; upstream changed the code line above the patch's.
    assert resolve_block(ours, base, theirs) == ([*ours, "    guard()\n"], "adjacent-edits")


def test_resolve_text_resolves_every_block_or_none() -> None:
    block = "".join(
        [
            "<<<<<<< HEAD\n",
            "    if nsa(cfg):  # DeepSeek 3.2/GLM 5\n",
            "||||||| parent\n",
            BASE_BLOCK[0],
            "=======\n",
            BASE_BLOCK[0],
            "        guard()\n",
            ">>>>>>> patch\n",
        ]
    )
    text = f"a = 1\n{block}b = 2\n"
    assert resolve_text(text) == (
        "a = 1\n    if nsa(cfg):  # DeepSeek 3.2/GLM 5\n        guard()\nb = 2\n",
        {REWORDED},
    )
    bad = block.replace("if nsa(cfg):  # DeepSeek 3.2/GLM 5", "if dsa(cfg):")
    assert resolve_text(text + bad) is None
    assert resolve_text(text + "<<<<<<< HEAD\nx\n") is None  # unterminated


def test_rebase_merges_past_a_comment_upstream_reworded(request: pytest.FixtureRequest) -> None:
    v10 = edited(BASE, (SA, "x_24 = 24\n", "x_24 = 24  # upstream's note\n"))
    series = [("0001-a.patch", [(SA, "x_25 = 25\n", "x_25 = 'fork'\n")])]
    fork = make_rebase_fork(request, {"v0.5.9": BASE, "v0.5.10": v10}, series)
    result = fork.rebase("v0.5.10")
    assert result.returncode == 0, result.stderr
    [patch] = fork.report()["patches"]
    assert patch["status"] == "merged"
    assert f"conflicted only where {PHRASES[REWORDED]}" in patch["detail"]
    assert patch["strategy"] == REWORDED
    text = fork.read(f"vendor/sglang/{SA}")
    assert "x_24 = 24  # upstream's note\n" in text
    assert "+x_25 = 'fork'" in fork.read("patches/0001-a.patch")


def test_an_import_both_sides_changed_takes_upstreams_layout_and_the_patchs_names() -> None:
    base = ["from sglang.srt.utils import get_device_sm, is_blackwell_supported\n"]
    ours = [
        "from sglang.srt.utils import (\n",
        "    get_device_sm,\n",
        "    is_blackwell_supported,\n",
        "    is_cuda,\n",
        ")\n",
    ]
    theirs = ["from sglang.srt.utils import get_device_sm, is_blackwell_supported, is_sm120\n"]
    merged = [*ours[:4], "    is_sm120,\n", ")\n"]
    assert resolve_block(ours, base, theirs) == (merged, IMPORTS)
    # A name the patch removed goes; a short result stays on one line.
    ours_short = ["from m import a, b, c\n"]
    assert resolve_block(ours_short, ["from m import a, b\n"], ["from m import b, z\n"]) == (
        ["from m import b, c, z\n"],
        IMPORTS,
    )


@pytest.mark.parametrize(
    "ours",
    [
        ["from other import a, b\n"],  # another module
        ["from m import a, b\n", "x = 1\n"],  # more than the import
        ["import m\n"],
    ],
)
def test_imports_of_different_shapes_stay_a_conflict(ours: list[str]) -> None:
    assert resolve_block(ours, ["from m import a\n"], ["from m import a, z\n"]) is None


def test_a_reworded_one_line_docstring_counts_as_a_comment() -> None:
    base = ['    """Validate for TRTLLM and tokenspeed MLA backends."""\n', "    if x:\n"]
    ours = ['    """Validate for the TRTLLM MLA backend."""\n', "    if x:\n"]
    theirs = [base[0], "    guard()\n", base[1]]
    assert resolve_block(ours, base, theirs) == ([ours[0], "    guard()\n", ours[1]], REWORDED)
    code = ['    s = "a"\n', "    if x:\n"]  # a string in an assignment is code
    theirs = [code[0], "    g()\n"]
    resolved = resolve_block(['    s = "b"\n', "    if x:\n"], code, theirs)
    assert resolved == (['    s = "b"\n', "    g()\n"], "adjacent-edits")  # not "docstring"


def test_names_inside_one_parenthesized_import_list() -> None:
    # 0.5.13: upstream added is_sm100_supported where the patch added is_sm120_supported.
    assert resolve_block(["    is_sm100_supported,\n"], [], ["    is_sm120_supported,\n"]) == (
        ["    is_sm100_supported,\n", "    is_sm120_supported,\n"],
        IMPORTS,
    )
    # 0.5.19: upstream dropped the name beside the patch's.
    assert resolve_block(
        [], ["    is_sm100_supported,\n"], ["    is_sm100_supported,\n", "    is_sm120,\n"]
    ) == (["    is_sm120,\n"], IMPORTS)
    # Not an import list: two insertions at one point, upstream's first.
    assert resolve_block(["    x = 1,\n"], [], ["    name,\n"]) == (
        ["    x = 1,\n", "    name,\n"],
        "two-insertions",
    )
