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
    assert "[0.5.11] carrying patch 1/3 0001-a.patch: merged" in result.stderr
    report = fork.report()
    assert report["releases"] == ["0.5.10", "0.5.11"]
    found = {p["name"]: (p["status"], p["first_break"]) for p in report["patches"]}
    assert found == {
        "0001-a.patch": ("merged", "0.5.11"),
        "0002-b.patch": ("upstreamed", "0.5.10"),
        "0003-c.patch": ("offset", None),
    }
    a, b, c = report["patches"]
    assert a["steps"] == [
        {"version": "0.5.10", "status": "clean"},
        {"version": "0.5.11", "status": "merged"},
    ]
    assert a["detail"].startswith("first needed a 3-way merge at 0.5.11; ")
    assert b["detail"].startswith("went upstream at 0.5.10; ")
    assert [s["version"] for s in b["steps"]] == ["0.5.10"]  # not carried further
    assert c["steps"][-1] == {"version": "0.5.11", "status": "clean"}
    # Only the final release lands.
    assert fork.read(f"vendor/sglang/{SA}") == V11[SA]
    assert 'version = "0.5.11"' in fork.read("vendor/sglang.lock")
    assert fork.read("patches/series") == "0001-a.patch\n0003-c.patch\n"
    changelog = fork.read("CHANGELOG.md")
    assert "- `0001-a.patch`: merged with upstream's changes" in changelog
    assert "(first needed a 3-way merge at 0.5.11)." in changelog


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
    result = fork.cli("rebase", "--continue")
    assert result.returncode == 0, result.stderr
    [patch] = fork.report()["patches"]
    assert (patch["status"], patch["first_break"]) == ("merged", "0.5.10")
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
