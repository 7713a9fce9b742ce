"""What `rebase` refuses before touching anything (exit 2), and --dry-run."""

from __future__ import annotations

import shutil
import tomllib
from pathlib import Path

import pytest
from hermetic import git
from rebasefork import BASE, SA, UT, RebaseFork, edited, make_rebase_fork

ROOT = Path(__file__).resolve().parents[1]
AFTER = edited(BASE, (SA, "x_25 = 25\n", "x_25 = 'upstream'\n"))
SERIES = [
    ("0001-util.patch", [(UT, "return False", "return None")]),
    ("0002-conflict.patch", [(SA, "x_25 = 25\n", "x_25 = 'fork'\n")]),
    ("0003-after.patch", [(SA, "x_60 = 60\n", "x_60 = 'fork'\n")]),
]


@pytest.fixture
def fork(request: pytest.FixtureRequest) -> RebaseFork:
    # The fork imports the first tag (0.5.9); 0.5.8 exists upstream too.
    return make_rebase_fork(request, {"v0.5.9": BASE, "v0.5.8": BASE, "v0.5.10": AFTER}, SERIES)


def refused(fork: RebaseFork, *args: str, via_git: bool = True) -> str:
    """The one error line; a refused start leaves only its report (result bad-input)."""
    before = fork.snapshot()
    result = fork.rebase(*args) if via_git else fork.cli("rebase", *args)
    assert result.returncode == 2, result.stderr
    assert fork.snapshot() == before
    assert not (fork.root / ".git/sm120fork-rebase").exists()
    [line] = result.stderr.splitlines()
    if via_git:  # `rebase VERSION`
        assert sorted(p.name for p in (fork.root / "build/rebase").iterdir()) == [
            "report.json", "report.md"
        ]  # fmt: skip
        report = fork.report()
        assert (report["result"], report["from"], report["patches"]) == ("bad-input", "0.5.9", [])
        assert line == f"sm120fork rebase: error: {report['error']}"
        shutil.rmtree(fork.root / "build")
    assert not (fork.root / "build").exists()
    return line


def test_dirty_tree(fork: RebaseFork) -> None:
    (fork.root / "vendor/sglang" / UT).write_text("edited by hand\n")
    assert "uncommitted changes (vendor/sglang/python/sglang/srt/utils.py)" in refused(
        fork, "v0.5.10"
    )


def test_unknown_version(fork: RebaseFork) -> None:
    line = refused(fork, "v0.5.99")
    assert "sglang v0.5.99 is not a release at file://" in line
    assert "nearest releases: 0.5.10, 0.5.9" in line


def test_version_older_than_the_pinned(fork: RebaseFork) -> None:
    assert "sglang 0.5.8 is older than the pinned 0.5.9" in refused(fork, "0.5.8")


@pytest.mark.parametrize("args", [("0.5.9",), ("v0.5.9", "--dry-run"), ("v0.5.9", "--step")])
def test_the_pinned_release_is_up_to_date(fork: RebaseFork, args: tuple[str, ...]) -> None:
    before = fork.snapshot()
    result = fork.rebase(*args)
    assert (result.returncode, result.stderr) == (0, ""), result.stderr
    assert result.stdout == (
        f"up to date with sglang 0.5.9: no newer release at {fork.url}; "
        f"report {fork.root}/build/rebase/report.md\n"
    )
    assert fork.snapshot() == before and fork.status() == ""
    assert not (fork.root / ".git/sm120fork-rebase").exists()
    assert fork.report() == {
        "from": "0.5.9",
        "to": "0.5.9",
        "source": "git",
        "result": "up-to-date",
        "patches": [],
        "gates": {kind: [] for kind in ("new", "changed", "moved", "removed", "unreviewed")},
    }
    assert "is the newest release: nothing to rebase" in fork.read("build/rebase/report.md")


def test_series_that_does_not_apply(fork: RebaseFork) -> None:
    (fork.root / "patches/0001-util.patch").write_bytes(
        (fork.root / "patches/0001-util.patch").read_bytes().replace(b"-    return", b"-  return")
    )
    git("commit", "-q", "-a", "-m", "break the series", cwd=fork.root)
    assert "the series must apply exactly to vendor/sglang" in refused(fork, "v0.5.10")


def test_continue_and_abort_without_a_rebase(fork: RebaseFork) -> None:
    assert "no rebase in progress" in refused(fork, "--continue", via_git=False)
    assert "no rebase in progress" in refused(fork, "--abort", via_git=False)
    assert "take no version" in refused(fork, "--continue", "v0.5.10", via_git=False)
    assert "name the release" in refused(fork, via_git=False)


def test_dry_run_writes_only_the_report(fork: RebaseFork) -> None:
    before = fork.snapshot()
    result = fork.rebase("v0.5.x", "--dry-run")
    assert result.returncode == 1, result.stderr  # it found the conflict
    assert f"0002-conflict.patch would conflict at {SA}:25" in result.stderr
    assert fork.snapshot() == before
    assert fork.status() == ""
    assert sorted(p.name for p in (fork.root / "build/rebase").iterdir()) == [
        "report.json", "report.md"
    ]  # fmt: skip
    assert not (fork.root / ".git/sm120fork-rebase").exists()
    report = fork.report()
    assert (report["to"], report["result"]) == ("0.5.10", "dry-run")
    assert fork.statuses() == {  # a dry run goes on past a conflict
        "0001-util.patch": "clean",
        "0002-conflict.patch": "conflict",
        "0003-after.patch": "clean",
    }
    assert report["patches"][1]["conflicts"][0]["line"] == 25
    assert "work_tree" not in report


def test_a_dry_run_that_stops_prints_its_report(
    fork: RebaseFork, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A patch with gate-table rows, and a release that declares no pins: no environment
    can decide its rows, so the dry run stops there (as the rebase would), and says so
    in its report, though its work tree is a scratch directory outside the fork."""
    monkeypatch.delenv("SM120_REBASE_GATE_ENV", raising=False)
    table = fork.root / "gatetable"
    table.mkdir()
    shutil.copy(ROOT / "gatetable/archs.toml", table / "archs.toml")
    archs = tomllib.loads((table / "archs.toml").read_text())
    cells = "".join(f'{arch} = "x"\n' for arch in archs)
    (table / "expectations.toml").write_text(
        f'[[row]]\nscenario = "s"\nfield = "f"\npatch = "0001-util.patch"\n{cells}'
    )
    git("add", "-A", ".", cwd=fork.root)
    git("commit", "-q", "-m", "rows", cwd=fork.root)
    result = fork.rebase("v0.5.10", "--dry-run")
    assert result.returncode == 1, result.stderr
    assert "Traceback" not in result.stderr
    assert "stopped at 0001-util.patch (sglang 0.5.10)" in result.stdout
    report = fork.report()
    assert report["result"] == "dry-run"
    assert fork.statuses() == {
        "0001-util.patch": "conflict",
        "0002-conflict.patch": "pending",
        "0003-after.patch": "pending",
    }
    assert "declares no pins" in report["patches"][0]["detail"]
    assert "stopped where the rebase would" in fork.read("build/rebase/report.md")
    assert fork.status() == ""


def test_a_damaged_state_is_refused_by_continue_and_cleared_by_abort(fork: RebaseFork) -> None:
    state = fork.root / ".git/sm120fork-rebase/state.json"
    state.parent.mkdir()
    state.write_text('{"format": 1, "targets": [')
    before = fork.snapshot()
    resumed = fork.cli("rebase", "--continue")
    assert resumed.returncode == 2
    [line] = resumed.stderr.splitlines()
    assert f"the rebase state {state} is damaged (JSONDecodeError: " in line
    assert line.endswith("run `rebase --abort`")
    aborted = fork.cli("rebase", "--abort")
    assert aborted.returncode == 0, aborted.stderr
    assert "warning: the rebase state" in aborted.stderr
    assert "aborted without a readable state" in aborted.stderr
    assert not state.parent.exists() and fork.snapshot() == before
