"""The rows on the git boundary (`sm120fork.gitcmd`): GitPython now, against the
boundary as it was before issue #18 (one `subprocess.run` a command, one
`git cat-file blob` process a file), rebuilt here with the same hermetic
environment so that both sides do the same work on the same repository.

Inputs: the vendored upstream files of this checkout's HEAD (`vendor/sglang`),
read as a rebase reads files of its work repository (`WorkRepo.read`). Set-up
(listing the files, warming the page cache) is not timed.

A row of issue #20 on the work repository itself: committing a carried patch
through the file it wrote against `git add -A .` + `git commit` of the whole
work tree (`WorkRepo.commit_worktree(paths)` against its route before).
"""

from __future__ import annotations

import itertools
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from bench_common import PROJECT, Row, compare, tool_env
from sm120fork import gitcmd
from sm120fork.paths import RepoPaths
from sm120fork.rebase.workrepo import WorkRepo

FILES = 400
COMMANDS = 100
_BEFORE_ENV = {
    "GIT_CONFIG_NOSYSTEM": "1",
    "LC_ALL": "C",
    "GIT_PAGER": "cat",
    "GIT_TERMINAL_PROMPT": "0",
}
_BEFORE_OPTIONS = [
    "-c",
    "core.quotepath=false",
    "-c",
    "core.autocrlf=false",
    "-c",
    "color.ui=false",
]


def _before(args: list[str]) -> subprocess.CompletedProcess[bytes]:
    """The boundary before #18: a plain subprocess a command."""
    return subprocess.run(
        ["git", *_BEFORE_OPTIONS, *args],
        cwd=PROJECT, capture_output=True, env={**os.environ, **_BEFORE_ENV}, check=False,
    )  # fmt: skip


def available() -> bool:
    probe = subprocess.run(
        ["git", "-C", str(PROJECT), "rev-parse", "--verify", "-q", "HEAD:vendor/sglang"],
        capture_output=True, check=False,
    )  # fmt: skip
    return probe.returncode == 0


def rows(runs: int) -> list[Row]:
    listing = gitcmd.output(
        ["ls-tree", "-r", "-z", "--name-only", "HEAD", "--", "vendor/sglang/python"], PROJECT
    )
    paths = sorted(p for p in listing.split("\0") if p.endswith(".py"))[:FILES]
    rows = [_read_row(runs, paths), _command_row(runs), _import_row(runs)]
    with tempfile.TemporaryDirectory(prefix="sm120-bench-work-") as scratch:
        rows.append(_patch_commit_row(runs, Path(scratch)))
    return rows


def _read_row(runs: int, paths: list[str]) -> Row:
    def ours() -> float:
        start = time.perf_counter()
        with gitcmd.ObjectReader(PROJECT) as objects:
            for path in paths:
                objects.read(f"HEAD:{path}")
        return time.perf_counter() - start

    def before() -> float:
        start = time.perf_counter()
        for path in paths:
            _before(["cat-file", "blob", f"HEAD:{path}"])
        return time.perf_counter() - start

    mine, theirs = compare(runs, ours, before)
    return Row(
        what=f"read {len(paths)} files of a commit (a rebase's `WorkRepo.read`)",
        ours="`gitcmd.ObjectReader`: one `git cat-file --batch` (GitPython)",
        baseline="before #18: a `git cat-file blob` process a file",
        ours_s=tuple(mine),
        baseline_s=tuple(theirs),
        target_ratio=1.0,
    )


def _command_row(runs: int) -> Row:
    def ours() -> float:
        start = time.perf_counter()
        for _ in range(COMMANDS):
            gitcmd.run(["rev-parse", "HEAD"], PROJECT)
        return time.perf_counter() - start

    def before() -> float:
        start = time.perf_counter()
        for _ in range(COMMANDS):
            _before(["rev-parse", "HEAD"])
        return time.perf_counter() - start

    mine, theirs = compare(runs, ours, before)
    return Row(
        what=f"{COMMANDS} small git commands (`rev-parse HEAD`)",
        ours="`gitcmd.run` (GitPython `Git.execute`)",
        baseline="before #18: `subprocess.run`, same environment",
        ours_s=tuple(mine),
        baseline_s=tuple(theirs),
        target_ratio=1.5,
    )


def _import_row(runs: int) -> Row:
    def fresh(code: str) -> float:
        start = time.perf_counter()
        subprocess.run([sys.executable, "-c", code], env=tool_env(), check=True)
        return time.perf_counter() - start

    mine, theirs = compare(
        runs,
        lambda: fresh("import sm120fork.gitcmd"),
        lambda: fresh("import subprocess, sm120fork.errors"),
    )
    return Row(
        what="start-up: a fresh python importing the git boundary",
        ours="`import sm120fork.gitcmd` (GitPython)",
        baseline="before #18: `subprocess` and `sm120fork.errors`",
        ours_s=tuple(mine),
        baseline_s=tuple(theirs),
        note="once per command",
    )


COMMITS = 20  # carried patches a run


def _patch_commit_row(runs: int, scratch: Path) -> Row:
    repo = WorkRepo.create(scratch / "carry")
    repo.checkout(repo.commit_dir(RepoPaths(PROJECT).upstream_tree, None, "sglang"))
    carried = "python/sglang/version.py"
    lines = itertools.count()

    def by_paths() -> None:
        repo.commit_worktree("sm120-bench.patch", (carried,))

    def by_whole_tree() -> None:  # commit_worktree before issue #20's change
        repo.git("add", "-A", ".")
        repo.git("diff", "--cached", "--quiet", "HEAD", check=False)
        repo.git("commit", "-q", "--no-verify", "-m", "sm120-bench.patch")
        repo.out("rev-parse", "HEAD")

    def commits(commit: Callable[[], None]) -> float:
        start = time.perf_counter()
        for _ in range(COMMITS):
            with (repo.root / carried).open("a") as file:
                file.write(f"# carried {next(lines)}\n")
            commit()
        return time.perf_counter() - start

    mine, theirs = compare(runs, lambda: commits(by_paths), lambda: commits(by_whole_tree))
    return Row(
        what=f"commit {COMMITS} carried patches in a work tree of the release",
        ours="`WorkRepo.commit_worktree(paths)`: `update-index` of the file, `commit-tree`",
        baseline="before #20: `git add -A .` + `git commit` (every file of the tree looked at)",
        ours_s=tuple(mine),
        baseline_s=tuple(theirs),
        target_ratio=1.0,
    )
