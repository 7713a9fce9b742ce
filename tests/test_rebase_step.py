"""`rebase --step`: carry release by release and name the first release that broke each patch."""

from __future__ import annotations

import pytest
from rebasefork import BASE, COMM, SA, UT, edited, make_rebase_fork, shifted

V10 = edited({**BASE, COMM: shifted(BASE[COMM])}, (UT, "return False", "return True"))
V11 = edited(V10, (SA, "x_27 = 27\n", "x_27 = 'upstream'\n"))
SERIES = [
    ("0001-a.patch", [(SA, "x_25 = 25\n", "x_25 = 'fork'\n")]),
    ("0002-b.patch", [(UT, "return False", "return True")]),
    ("0003-c.patch", [(COMM, "c_5 = 5\n", "c_5 = 'fork'\n")]),
]


def test_step_names_the_first_release_that_broke_each_patch(request: pytest.FixtureRequest) -> None:
    versions = {"v0.5.9": BASE, "v0.5.10": V10, "v0.5.11": V11, "v0.5.12": V11}
    fork = make_rebase_fork(request, versions, SERIES)
    result = fork.rebase("v0.5.11", "--step")
    assert result.returncode == 0, result.stderr
    assert (
        "release 2/2 sglang 0.5.11: carrying patch 1/3 0001-a.patch: merged (3-way merge by git"
        in result.stderr
    )
    report = fork.report()
    assert report["releases"] == ["0.5.10", "0.5.11"]
    found = {p["name"]: (p["status"], p["first_break"]) for p in report["patches"]}
    assert found == {
        "0001-a.patch": ("merged", "0.5.11"),
        "0002-b.patch": ("upstreamed", "0.5.10"),
        "0003-c.patch": ("offset", None),
    }
    a, b, c = report["patches"]
    assert [(s["version"], s["status"], s["by_hand"]) for s in a["steps"]] == [
        ("0.5.10", "clean", False),
        ("0.5.11", "merged", False),
    ]
    assert [s["strategy"] for s in a["steps"]] == ["exact", "3-way"]
    assert a["detail"].startswith("first needed a 3-way merge at 0.5.11; ")
    assert b["detail"].startswith("went upstream at 0.5.10; ")
    assert [s["version"] for s in b["steps"]] == ["0.5.10"]  # not carried further
    assert (c["steps"][-1]["version"], c["steps"][-1]["status"]) == ("0.5.11", "clean")
    # Only the final release lands.
    assert fork.read(f"vendor/sglang/{SA}") == V11[SA]
    assert 'version = "0.5.11"' in fork.read("vendor/sglang.lock")
    assert fork.read("patches/series") == "0001-a.patch\n0003-c.patch\n"
    changelog = fork.read("CHANGELOG.md")
    assert "- `0001-a.patch`: merged with upstream's changes" in changelog
    assert "(first needed a 3-way merge at 0.5.11) [strategy: 3-way]." in changelog
    # One entry per release walked, newest first, each saying what happened there.
    newest, walked = changelog.split("## 0.5.10+sm120.1 - ", 1)
    assert "## 0.5.11+sm120.1 - " in newest
    assert "- `0002-b.patch`: dropped as upstreamed: " in walked
    assert "- `0001-a.patch`: carried unchanged [strategy: exact]." in walked
    assert "No longer in the series (dropped at an earlier release): `0002-b.patch`" in newest
    assert "### Across the walk from 0.5.9" in newest
    # The report holds the same, release by release.
    walk = {r["version"]: r for r in report["walk"]}
    assert list(walk) == ["0.5.10", "0.5.11"]
    assert [p["name"] for p in walk["0.5.11"]["patches"]] == ["0001-a.patch", "0003-c.patch"]
    assert walk["0.5.10"]["patches"][1]["status"] == "upstreamed"
    assert "### sglang 0.5.10" in fork.read("build/rebase/report.md")


def test_step_conflict_at_an_intermediate_release(request: pytest.FixtureRequest) -> None:
    v10 = edited(BASE, (SA, "x_25 = 25\n", "x_25 = 'upstream'\n"))
    v11 = edited(v10, (SA, "x_70 = 70\n", "x_70 = 'upstream'\n"))
    versions = {"v0.5.9": BASE, "v0.5.10": v10, "v0.5.11": v11}
    fork = make_rebase_fork(request, versions, SERIES[:1])
    result = fork.rebase("v0.5.11", "--step")
    assert result.returncode == 1, result.stderr
    [patch] = fork.report()["patches"]
    assert (patch["status"], patch["first_break"]) == ("conflict", "0.5.10")
    assert patch["detail"].startswith("first conflicted at 0.5.10; the 3-way merge onto 0.5.10")
    (fork.root / "build/rebase/work" / SA).write_text(
        v10[SA].replace("x_25 = 'upstream'\n", "x_25 = 'both'\n")
    )
    result = fork.cli("rebase", "--continue", "--note", "upstream set x_25 itself")
    assert result.returncode == 0, result.stderr
    [patch] = fork.report()["patches"]
    assert (patch["status"], patch["first_break"]) == ("merged", "0.5.10")
    assert patch["steps"][0]["note"] == "upstream set x_25 itself"
    entry_010 = fork.read("CHANGELOG.md").split("## 0.5.10+sm120.1 - ", 1)[1]
    assert "rewritten by hand (the tool could not: upstream set x_25 itself)" in entry_010
    assert patch["detail"].startswith("first conflicted at 0.5.10 (resolved by hand); ")
    assert [s["status"] for s in patch["steps"]] == ["merged", "clean"]
    assert fork.read(f"vendor/sglang/{SA}") == v11[SA]
    assert "+x_25 = 'both'" in fork.read("patches/0001-a.patch")


def test_dry_run_step_names_the_release_of_a_conflict_not_the_target(
    request: pytest.FixtureRequest,
) -> None:
    v10 = edited(BASE, (SA, "x_25 = 25\n", "x_25 = 'upstream'\n"))
    v11 = edited(v10, (SA, "x_70 = 70\n", "x_70 = 'upstream'\n"))
    versions = {"v0.5.9": BASE, "v0.5.10": v10, "v0.5.11": v11}
    fork = make_rebase_fork(request, versions, SERIES[:1])
    result = fork.rebase("v0.5.11", "--step", "--dry-run")
    assert result.returncode == 1, result.stderr
    [patch] = fork.report()["patches"]
    assert (patch["status"], patch["first_break"]) == ("conflict", "0.5.10")
    assert [(s["version"], s["status"]) for s in patch["steps"]] == [("0.5.10", "conflict")]


def test_drop_a_conflicted_patch_with_its_reason(request: pytest.FixtureRequest) -> None:
    v10 = edited(BASE, (SA, "x_25 = 25\n", "x_25 = 'upstream'\n"))
    v11 = edited(v10, (SA, "x_70 = 70\n", "x_70 = 'upstream'\n"))
    versions = {"v0.5.9": BASE, "v0.5.10": v10, "v0.5.11": v11}
    fork = make_rebase_fork(request, versions, SERIES[:2])
    assert fork.rebase("v0.5.11", "--step").returncode == 1
    (fork.root / "build/rebase/work" / SA).write_text("half an edit\n")  # thrown away
    result = fork.cli("rebase", "--drop", "upstream 0.5.10 sets x_25 its own way")
    assert result.returncode == 0, result.stderr
    a, _ = fork.report()["patches"]
    assert a["status"] == "dropped"
    assert a["detail"].startswith("conflicted at 0.5.10 and was dropped by hand; dropped by hand")
    assert fork.read("patches/series") == "0002-b.patch\n"
    assert fork.read(f"vendor/sglang/{SA}") == v11[SA]  # the edit went with the patch
    changelog = fork.read("CHANGELOG.md")
    assert "conflicted; dropped by hand: upstream 0.5.10 sets x_25 its own way." in changelog


def test_note_and_drop_need_a_conflict(request: pytest.FixtureRequest) -> None:
    fork = make_rebase_fork(request, {"v0.5.9": BASE, "v0.5.10": V10}, SERIES[:1])
    before = fork.snapshot()
    for args in (["--continue", "--note", "why"], ["--drop", "why"], ["--note", "why"]):
        result = fork.cli("rebase", *args)
        assert result.returncode == 2, result.stderr
        assert len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert fork.snapshot() == before
