"""kill -9 at any phase: --continue finishes the rebase, --abort restores the state before it.

The CLI runs in a subprocess that ends itself with os._exit(137) at a named
point ($SM120FORK_REBASE_CRASH_AT, see sm120fork.rebase.state).
"""

from __future__ import annotations

import pytest
from rebasefork import BASE, COMM, SA, UT, RebaseFork, edited, make_rebase_fork, shifted
from sm120fork.cli import main
from sm120fork.upstream import lock

AFTER = edited(
    {**BASE, SA: shifted(BASE[SA])},
    (SA, "x_27 = 27\n", "x_27 = 'upstream'\n"),
    (UT, "return False", "return True"),
)
SERIES = [
    ("0001-clean.patch", [(COMM, "c_5 = 5\n", "c_5 = 'fork'\n")]),
    ("0002-merged.patch", [(SA, "x_25 = 25\n", "x_25 = 'fork'\n")]),
    ("0003-upstreamed.patch", [(UT, "return False", "return True")]),
]
STATUSES = {
    "0001-clean.patch": "clean",
    "0002-merged.patch": "merged",
    "0003-upstreamed.patch": "upstreamed",
}
POINTS = [
    "after-fetch",
    "after-prepare",
    "mid-carry",
    "after-patch-1",
    "mid-stage",
    "after-stage",
    "mid-swap",
    "after-swap",
]


@pytest.fixture
def fork(request: pytest.FixtureRequest) -> RebaseFork:
    return make_rebase_fork(request, {"v0.5.9": BASE, "v0.5.10": AFTER}, SERIES)


def crash(fork: RebaseFork, point: str) -> None:
    result = fork.rebase("v0.5.10", crash_at=point)
    assert result.returncode == 137, result.stderr


def assert_landed(fork: RebaseFork, capsys: pytest.CaptureFixture[str]) -> None:
    assert fork.statuses() == STATUSES
    assert fork.report()["result"] == "complete"
    assert (fork.root / "vendor/sglang" / SA).read_text() == AFTER[SA]
    locked = lock.read(fork.root / "vendor/sglang.lock")
    assert locked is not None and locked.version == "0.5.10"
    assert fork.read("patches/series") == "0001-clean.patch\n0002-merged.patch\n"
    assert fork.read("CHANGELOG.md").count("## 0.5.10+sm120.1") == 1
    leftovers = [p.name for p in fork.root.rglob(".*.rebase-*")]
    assert leftovers == []
    assert not (fork.root / ".git/sm120fork-rebase").exists()
    assert main(["-C", str(fork.root), "check"]) == 0, capsys.readouterr().out


@pytest.mark.slow
@pytest.mark.parametrize("point", POINTS)
def test_crash_then_continue(
    fork: RebaseFork, point: str, capsys: pytest.CaptureFixture[str]
) -> None:
    crash(fork, point)
    again = fork.rebase("v0.5.10")
    assert again.returncode == 2 and "already in progress" in again.stderr
    result = fork.cli("rebase", "--continue")
    assert result.returncode == 0, result.stderr
    assert_landed(fork, capsys)


@pytest.mark.slow
@pytest.mark.parametrize("point", [p for p in POINTS if p != "after-swap"])
def test_crash_then_abort(fork: RebaseFork, point: str) -> None:
    before = fork.snapshot()
    crash(fork, point)
    result = fork.cli("rebase", "--abort")
    assert result.returncode == 0, result.stderr
    assert fork.snapshot() == before
    assert fork.status() == ""
    assert not (fork.root / "build/rebase").exists()
    assert not (fork.root / ".git/sm120fork-rebase").exists()


def test_abort_after_the_swap_completes_instead(fork: RebaseFork) -> None:
    crash(fork, "after-swap")
    result = fork.cli("rebase", "--abort")
    assert result.returncode == 2
    assert "already landed" in result.stderr
    assert fork.statuses() == STATUSES
    assert not (fork.root / ".git/sm120fork-rebase").exists()


def test_crash_while_recording_a_resolution(request: pytest.FixtureRequest) -> None:
    after = edited(BASE, (SA, "x_25 = 25\n", "x_25 = 'upstream'\n"))
    fork = make_rebase_fork(request, {"v0.5.9": BASE, "v0.5.10": after}, SERIES)
    assert fork.rebase("v0.5.10").returncode == 1
    (fork.root / "build/rebase/work" / SA).write_text(
        after[SA].replace("x_25 = 'upstream'\n", "x_25 = 'both'\n")
    )
    result = fork.cli("rebase", "--continue", crash_at="resolved")
    assert result.returncode == 137, result.stderr
    result = fork.cli("rebase", "--continue")
    assert result.returncode == 0, result.stderr
    assert fork.statuses()["0002-merged.patch"] == "merged"
    assert "+x_25 = 'both'" in fork.read("patches/0002-merged.patch")


def test_a_running_rebase_keeps_a_second_process_out(fork: RebaseFork) -> None:
    import fcntl

    with open(fork.root / ".git/sm120fork-rebase.lock", "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        result = fork.rebase("v0.5.10")
    assert result.returncode == 2
    assert "another `sm120fork rebase` is running" in result.stderr
    assert not (fork.root / "build/rebase").exists()
