"""A carried patch that uses a name upstream stopped defining stops the rebase (names.py)."""

from __future__ import annotations

import pytest
from rebasefork import BASE, SA, edited, make_rebase_fork
from sm120fork.rebase.names import _problems

# The pinned release imports `helper`; the next one drops the import (same line count,
# so the patch still applies exactly) - as 0.5.21 did with `is_sm120_supported`.
PINNED = edited(BASE, (SA, "x_1 = 1\n", "from m import helper\n"))
NEXT = edited(PINNED, (SA, "from m import helper\n", "x_1 = 1\n"))
SERIES = [("0001-uses-helper.patch", [(SA, "x_25 = 25\n", "x_25 = helper()\n")])]


def test_a_patch_that_applies_but_uses_a_vanished_name_is_a_conflict(
    request: pytest.FixtureRequest,
) -> None:
    fork = make_rebase_fork(request, {"v0.5.9": PINNED, "v0.5.10": NEXT}, SERIES)
    result = fork.rebase("v0.5.10")
    assert result.returncode == 1, result.stderr
    [patch] = fork.report()["patches"]
    assert patch["status"] == "conflict"
    assert "it was carried (clean, by exact), but its own lines break on 0.5.10" in patch["detail"]
    assert "undefined name `helper` (server_args.py:25)" in patch["detail"]
    [conflict] = patch["conflicts"]
    assert (conflict["file"], conflict["line"], conflict["ours"]) == (SA, 25, "x_25 = helper()")
    work = fork.root / "build/rebase/work" / SA
    assert "x_25 = helper()\n" in work.read_text()  # left for the person, uncommitted

    # A resolution that still breaks is refused, and the edit stays for another try.
    result = fork.cli("rebase", "--continue", "--note", "first try")
    assert result.returncode == 1
    assert "the resolution breaks: undefined name `helper`" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1

    work.write_text("from m import helper\n" + work.read_text())
    result = fork.cli("rebase", "--continue", "--note", "upstream dropped the import")
    assert result.returncode == 0, result.stderr
    [patch] = fork.report()["patches"]
    assert patch["status"] == "merged"
    text = fork.read("patches/0001-uses-helper.patch")
    assert "+from m import helper" in text and "+x_25 = helper()" in text


def test_what_counts_as_broken() -> None:
    assert _problems("x = (\n", "f.py") == [(1, "does not parse: '(' was never closed")]
    assert _problems("import os\nos.sep\nundefined_x\n", "f.py") == [
        (3, "undefined name `undefined_x`")
    ]


def test_upstreams_own_undefined_names_are_not_the_patchs(request: pytest.FixtureRequest) -> None:
    nxt = edited(BASE, (SA, "x_70 = 70\n", "x_70 = not_defined_anywhere\n"))
    series = [("0001-a.patch", [(SA, "x_25 = 25\n", "x_25 = 'fork'\n")])]
    fork = make_rebase_fork(request, {"v0.5.9": BASE, "v0.5.10": nxt}, series)
    result = fork.rebase("v0.5.10", "--dry-run")
    assert result.returncode == 0, result.stderr
    assert fork.statuses() == {"0001-a.patch": "clean"}
