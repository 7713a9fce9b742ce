"""The upstream watch workflow's shell steps, run against scratch fork repositories.

`nox` is a stand-in that runs the tool against the test's upstream remote and,
like nox, exits 1 on any failure; `gh` records what it is asked. The steps must
tell the outcomes apart from the outputs the tool writes to $GITHUB_OUTPUT, not
from nox's exit code: a day with no new release ends green and opens nothing; a
conflict opens one issue; a clean rebase pushes a branch and opens one pull
request; bad input, or no outcome at all, fails the job.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
from hermetic import git
from hermetic import output as git_output
from rebasefork import BASE, SA, RebaseFork, edited, make_rebase_fork
from workflowrun import StepRun, load_steps, run_job

PROJECT = Path(__file__).resolve().parents[1]
WORKFLOW = PROJECT / ".github" / "workflows" / "upstream-watch.yml"
SETUP = frozenset({"System tools (GNU quilt)", "python -m pip install nox"})
SERIES = [("0001-gate.patch", [(SA, "x_25 = 25\n", "x_25 = 'fork'\n")])]
CONFLICTING = edited(BASE, (SA, "x_25 = 25\n", "x_25 = 'upstream'\n"))
CARRIED = edited(BASE, (SA, "x_70 = 70\n", "x_70 = 'upstream'\n"))

NOX = """#!/usr/bin/env bash
# nox -s rebase -- ARGS: the tool on the test's remote; any failure is exit 1, as in nox.
[ "$1 $2 $3" = "-s rebase --" ] || { echo "stand-in nox: unexpected $*" >&2; exit 2; }
shift 3
"$TEST_PYTHON" -m sm120fork rebase "$@" --upstream-git "$TEST_UPSTREAM" || exit 1
"""
GH = """#!/usr/bin/env bash
printf '%s\\n' "$*" >> "$GH_LOG"
case "$1 $2" in "issue list"|"pr list") printf '%s' "${GH_EXISTING:-}" ;; esac
"""


@dataclass(frozen=True)
class Watch:
    runs: dict[str, StepRun]
    gh: list[str]  # the gh command lines, in order

    def ran(self) -> list[str]:
        return [name for name, run in self.runs.items() if run.ran]

    def green(self) -> bool:
        return all(run.returncode == 0 for run in self.runs.values())


def tools(tmp_path: Path) -> Path:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, text in (("nox", NOX), ("gh", GH)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    (bin_dir / "python").symlink_to(sys.executable)
    return bin_dir


def watch(
    fork: RebaseFork,
    tmp_path: Path,
    url: str | None = None,
    existing: str = "",
    python: str = sys.executable,
) -> Watch:
    steps = load_steps(WORKFLOW, "rebase")
    assert {step.name for step in steps} >= SETUP, "the setup steps this test skips changed"
    gh_log = tmp_path / f"gh-{len(list(tmp_path.glob('gh-*.log')))}.log"
    gh_log.write_text("")
    bin_dir = tmp_path / "bin" if (tmp_path / "bin").exists() else tools(tmp_path)
    env = {
        **os.environ,
        "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
        "PYTHONPATH": str(PROJECT / "scripts"),
        "TEST_PYTHON": python,
        "TEST_UPSTREAM": url or fork.url,
        "GH_LOG": str(gh_log),
        "GH_EXISTING": existing,
    }
    runs = run_job(steps, fork.root, env, skip=SETUP)
    return Watch({run.name: run for run in runs}, gh_log.read_text().splitlines())


def fork_with(request: pytest.FixtureRequest, versions: dict[str, dict[str, str]]) -> RebaseFork:
    return make_rebase_fork(request, versions, SERIES)


def test_a_day_without_a_new_release_ends_green_and_opens_nothing(
    request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    fork = fork_with(request, {"v0.5.9": BASE})
    result = watch(fork, tmp_path)
    assert result.green(), {name: run.output for name, run in result.runs.items()}
    assert result.ran() == ["Is there a newer release?"]
    assert (
        "rebase outcome: up-to-date (sglang 0.5.9)"
        in result.runs["Is there a newer release?"].output
    )
    assert result.gh == []
    assert fork.status() == ""
    assert fork.report()["result"] == "up-to-date"


def test_a_conflict_opens_one_issue_and_no_pull_request(
    request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    fork = fork_with(request, {"v0.5.9": BASE, "v0.5.10": CONFLICTING})
    result = watch(fork, tmp_path)
    assert result.green(), {name: run.output for name, run in result.runs.items()}
    assert result.ran() == [
        "Is there a newer release?",
        "Rebase onto it",
        "Open an issue when a patch needs a person",
    ]
    title = "Upstream rebase onto sglang 0.5.10 stopped on a conflict"
    assert result.gh[-1] == f"issue create --title {title} --body-file build/rebase/report.md"
    assert [line.split()[:2] for line in result.gh] == [["issue", "list"], ["issue", "create"]]
    assert fork.report()["result"] == "conflict"
    # The next day, on a fresh checkout, the same conflict opens no second issue.
    clone = tmp_path / "next-day"
    git("clone", "-q", str(fork.root), str(clone), cwd=tmp_path)
    again = watch(RebaseFork(clone, fork.url), tmp_path, existing="17")
    assert again.green() and [line.split()[:2] for line in again.gh] == [["issue", "list"]]


def test_a_clean_rebase_pushes_a_branch_and_opens_one_pull_request(
    request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    fork = fork_with(request, {"v0.5.9": BASE, "v0.5.10": CARRIED})
    origin = tmp_path / "origin.git"
    git("init", "-q", "--bare", str(origin), cwd=tmp_path)
    git("remote", "add", "origin", str(origin), cwd=fork.root)
    result = watch(fork, tmp_path)
    assert result.green(), {name: run.output for name, run in result.runs.items()}
    assert result.ran() == [
        "Is there a newer release?",
        "Rebase onto it",
        "Open a pull request with the report",
    ]
    assert result.gh[-1] == (
        "pr create --base main --head upstream/v0.5.10 --title Rebase onto sglang 0.5.10 "
        "--body-file build/rebase/report.md"
    )
    pushed = git_output("log", "--format=%s", "-1", "upstream/v0.5.10", cwd=origin)
    assert pushed == "Rebase the series onto sglang 0.5.10"
    assert fork.report()["result"] == "complete"


def test_bad_input_fails_the_job_and_opens_nothing(
    request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    fork = fork_with(request, {"v0.5.9": BASE})
    result = watch(fork, tmp_path, url=(tmp_path / "no-such-remote").as_uri())
    probe = result.runs["Is there a newer release?"]
    assert probe.returncode != 0
    assert "::error::the rebase refused: `git ls-remote" in probe.output
    assert result.ran() == ["Is there a newer release?"]
    assert result.gh == []


def test_a_rebase_that_writes_no_outcome_fails_the_job(
    request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    """A crash before the tool wrote its outcome (here: no tool at all) is no green day."""
    fork = fork_with(request, {"v0.5.9": BASE, "v0.5.10": CARRIED})
    result = watch(fork, tmp_path, python="false")
    probe = result.runs["Is there a newer release?"]
    assert probe.returncode != 0
    assert "::error::the rebase gave no outcome to go on" in probe.output
    assert result.ran() == ["Is there a newer release?"]
    assert result.gh == []
