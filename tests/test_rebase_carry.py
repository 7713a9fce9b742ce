"""`sm120fork rebase`: one scenario per patch status, on real git, from a local remote."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from rebasefork import BASE, COMM, DATE, SA, UT, edited, make_rebase_fork, shifted
from sm120fork.cli import main
from sm120fork.forkversion import read_fork_version
from sm120fork.patches.patchfile import load_patch
from sm120fork.upstream import lock, manifest

# 0.5.10 of the "every status" scenario: five lines on top of server_args.py,
# a change two lines below patch 3's, and the changes of patches 4 and 5.
AFTER = edited(
    {**BASE, SA: shifted(BASE[SA])},
    (SA, "x_27 = 27\n", "x_27 = 'upstream'\n"),
    (UT, "return False", "return True"),
    (SA, "x_60 = 60\n", "x_60 = 'sixty'\n"),
    (SA, "x_62 = 62\n", "x_62 = 'upstream'\n"),
    (COMM, "c_28 = 28\n", "c_28 = 'upstream'\n"),
)
SERIES = [
    ("0001-clean.patch", [(COMM, "c_5 = 5\n", "c_5 = 'fork'\n")]),
    ("0002-offset.patch", [(SA, "x_10 = 10\n", "x_10 = 'fork'\n")]),
    ("0003-merged.patch", [(SA, "x_25 = 25\n", "x_25 = 'fork'\n")]),
    ("0004-reverse.patch", [(UT, "return False", "return True")]),
    ("0005-empty.patch", [(SA, "x_60 = 60\n", "x_60 = 'sixty'\n")]),
]


@pytest.fixture
def carried(request: pytest.FixtureRequest) -> Path:
    fork = make_rebase_fork(request, {"v0.5.9": BASE, "v0.5.10": AFTER}, SERIES)
    before = fork.snapshot()
    original = (fork.root / "patches/0001-clean.patch").read_bytes()
    result = fork.rebase("v0.5.10")
    assert result.returncode == 0, result.stderr
    assert "carrying patch 3/5 0003-merged.patch: merged" in result.stderr
    assert fork.snapshot() != before
    assert (fork.root / "patches/0001-clean.patch").read_bytes() == original
    return fork.root


def test_every_status_and_its_detail(carried: Path) -> None:
    report = json.loads((carried / "build/rebase/report.json").read_text())
    assert {k: report[k] for k in ("from", "to", "source", "result")} == {
        "from": "0.5.9",
        "to": "0.5.10",
        "source": "git",
        "result": "complete",
    }
    assert [(p["name"], p["status"]) for p in report["patches"]] == [
        ("0001-clean.patch", "clean"),
        ("0002-offset.patch", "offset"),
        ("0003-merged.patch", "merged"),
        ("0004-reverse.patch", "upstreamed"),
        ("0005-empty.patch", "upstreamed"),
    ]
    # Which strategy of carry.STRATEGIES carried or dropped each one.
    assert [p["strategy"] for p in report["patches"]] == [
        "exact", "offset", "3-way", "reverse", "3-way"
    ]  # fmt: skip
    details = {p["name"]: p["detail"] for p in report["patches"]}
    assert "server_args.py +5" in details["0002-offset.patch"]
    assert "reverse-applies" in details["0004-reverse.patch"]
    assert "3-way merge leaves an empty diff" in details["0005-empty.patch"]
    assert all(p["conflicts"] == [] for p in report["patches"])
    assert set(report["gates"]) == {"new", "changed", "moved", "removed", "unreviewed"}


def test_landed_tree_lock_series_and_patch_bytes(
    carried: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert (carried / "vendor/sglang" / SA).read_text() == AFTER[SA]
    locked = lock.read(carried / "vendor/sglang.lock")
    assert locked is not None
    assert (locked.version, locked.source, locked.imported) == ("0.5.10", "git", DATE)
    landed = manifest.read(carried / "vendor/sglang.sha256")
    assert landed is not None and landed.version == "0.5.10"
    assert landed.hashes()[SA] == manifest.sha256_hex(AFTER[SA].encode())
    assert manifest.verify(carried / "vendor/sglang", landed) == []
    patches = carried / "patches"
    assert (patches / "series").read_text() == (
        "0001-clean.patch\n0002-offset.patch\n0003-merged.patch\n"
    )
    assert not (patches / "0004-reverse.patch").exists()
    assert not (patches / "0005-empty.patch").exists()
    # No stray staging or backup copies, no state, no work area.
    assert sorted(p.name for p in carried.iterdir()) == [
        ".git", ".gitignore", "CHANGELOG.md", "build", "patches", "vendor"
    ]  # fmt: skip
    assert sorted(p.name for p in (carried / "build/rebase").iterdir()) == [
        "report.json", "report.md"
    ]  # fmt: skip
    assert not (carried / ".git/sm120fork-rebase").exists()
    # An unchanged patch keeps its bytes (and Last-Update); changed ones get today.
    # (the fixture checked that 0001-clean.patch kept its bytes)
    for name in ("0002-offset.patch", "0003-merged.patch"):
        field = load_patch(patches / name).header.get("Last-Update")
        assert field is not None and field.value == DATE
    offset = (patches / "0002-offset.patch").read_text()
    assert "@@ -12,7 +12,7 @@" in offset and "@@ -7,7 +7,7 @@" not in offset
    assert "x_27 = 'upstream'" in (patches / "0003-merged.patch").read_text()
    # The result is a consistent series in normal form on the new tree.
    assert main(["-C", str(carried), "check"]) == 0, capsys.readouterr().out


def test_changelog_entry_and_markdown_report(carried: Path) -> None:
    text = (carried / "CHANGELOG.md").read_text()
    assert text.startswith("# Changelog\n\n## 0.5.10+sm120.1 - 2026-12-01\n\n### Upstream\n")
    assert text.index("## 0.5.10+sm120.1") < text.index("## 0.5.9+sm120.1")
    assert "- `0001-clean.patch`: carried unchanged [strategy: exact]." in text
    assert (
        "- `0002-offset.patch`: refreshed (it applied at shifted lines) [strategy: offset]."
    ) in text
    assert "- `0004-reverse.patch`: dropped as upstreamed: upstream 0.5.10 already" in text
    assert "### Gates\n" in text
    assert read_fork_version(carried / "CHANGELOG.md", "0.5.10").n == 1
    md = (carried / "build/rebase/report.md").read_text()
    assert "From sglang 0.5.9 to 0.5.10 (git): **complete**" in md
    assert "| `0003-merged.patch` | merged | 3-way |" in md
    assert "## Gates" in md
