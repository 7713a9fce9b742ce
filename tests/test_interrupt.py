"""Ctrl-C: the CLI exits 130, and a rebase it started leaves the repository as
`rebase --abort` would (a crash, kill -9, keeps the state for --continue instead:
test_rebase_crash.py)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from rebasefork import BASE, COMM, SA, RebaseFork, edited, make_rebase_fork, shifted
from sm120fork.cli import main
from sm120fork.errors import EXIT_INTERRUPTED
from sm120fork.rebase import landing, phases

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"
AFTER = edited({**BASE, SA: shifted(BASE[SA])}, (SA, "x_27 = 27\n", "x_27 = 'upstream'\n"))
SERIES = [
    ("0001-clean.patch", [(COMM, "c_5 = 5\n", "c_5 = 'fork'\n")]),
    ("0002-merged.patch", [(SA, "x_25 = 25\n", "x_25 = 'fork'\n")]),
]


@pytest.fixture
def fork(request: pytest.FixtureRequest) -> RebaseFork:
    return make_rebase_fork(request, {"v0.5.9": BASE, "v0.5.10": AFTER}, SERIES)


def test_sigint_exits_130(tmp_path: Path) -> None:
    """A real SIGINT while a command runs: exit 130 and one line, no traceback."""
    script = textwrap.dedent(
        """
        import os, signal, sys
        from sm120fork import cli
        from sm120fork.commands import check
        # A job started in the background inherits SIGINT ignored, and Python then
        # keeps it ignored: restore the handler a terminal's Ctrl-C would meet.
        signal.signal(signal.SIGINT, signal.default_int_handler)
        check.run = lambda args: os.kill(os.getpid(), signal.SIGINT)
        (cli.Path(sys.argv[1]) / "patches").mkdir()
        (cli.Path(sys.argv[1]) / "patches" / "series").write_text("")
        raise SystemExit(cli.main(["-C", sys.argv[1], "check"]))
        """
    )
    env = {**os.environ, "PYTHONPATH": str(SCRIPTS)}
    done = subprocess.run(
        [sys.executable, "-c", script, str(tmp_path)],
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )
    assert done.returncode == EXIT_INTERRUPTED, done.stderr
    assert done.stderr == "sm120fork check: interrupted\n"


@pytest.mark.parametrize("point", ["after-prepare", "mid-swap"])
def test_ctrl_c_in_a_rebase_leaves_it_as_abort_would(
    fork: RebaseFork, point: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Interrupted while carrying, or with vendor/ half swapped: nothing changed."""

    def interrupt(name: str) -> None:
        if name == point:
            raise KeyboardInterrupt

    monkeypatch.setattr(phases, "crash_point", interrupt)
    monkeypatch.setattr(landing, "crash_point", interrupt)
    before = fork.snapshot()
    code = main(["-C", str(fork.root), "rebase", "v0.5.10", "--upstream-git", fork.url])
    assert code == EXIT_INTERRUPTED
    assert fork.snapshot() == before
    assert fork.status() == ""
    assert not (fork.root / "build/rebase/work").exists()
    assert not (fork.root / ".git/sm120fork-rebase").exists()


def test_ctrl_c_in_continue_keeps_the_rebase(
    request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch
) -> None:
    """--continue interrupted: the person's resolution stays for the next --continue."""
    after = edited(BASE, (SA, "x_25 = 25\n", "x_25 = 'upstream'\n"))
    fork = make_rebase_fork(request, {"v0.5.9": BASE, "v0.5.10": after}, SERIES)
    assert fork.rebase("v0.5.10").returncode == 1
    resolved = fork.root / "build/rebase/work" / SA
    resolved.write_text(after[SA].replace("x_25 = 'upstream'\n", "x_25 = 'both'\n"))

    def interrupt(name: str) -> None:
        if name == "mid-stage":
            raise KeyboardInterrupt

    monkeypatch.setattr(landing, "crash_point", interrupt)
    assert main(["-C", str(fork.root), "rebase", "--continue"]) == EXIT_INTERRUPTED
    assert (fork.root / ".git/sm120fork-rebase").exists()
    assert fork.cli("rebase", "--continue").returncode == 0
    assert "+x_25 = 'both'" in fork.read("patches/0002-merged.patch")
