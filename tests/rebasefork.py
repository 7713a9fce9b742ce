"""Fork repositories for the rebase tests: an upstream git remote with release tags,
a fork that imported its first release from it, a series, a CHANGELOG, all committed.

Kept apart from conftest.py so that the rebase tests own their helpers; git is
hermetic through conftest's `make_upstream_git_repo` (temp HOME, fixed dates).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from forkrepo import edit, make_patch
from hermetic import git
from hermetic import output as git_output
from sm120fork.cli import main
from sm120fork.rebase.state import CRASH_ENV

DATE = "2026-12-01"  # $SM120FORK_DATE of every rebase test
SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"
CHANGELOG = "# Changelog\n\n## 0.5.9+sm120.1 - 2026-11-01\n\n### Upstream\n- sglang 0.5.9.\n"
SA = "python/sglang/srt/server_args.py"
COMM = "python/sglang/srt/layers/communicator.py"
UT = "python/sglang/srt/utils.py"

# 0.5.9: files of numbered lines, so each test states exactly what upstream changes;
# line 40 of server_args.py is an architecture gate.
SA_TEXT = "".join(f"x_{i} = {i}\n" for i in range(1, 81)).replace(
    "x_40 = 40\n", "if is_sm100_supported(): x_40 = 40\n"
)
BASE: dict[str, str] = {
    SA: SA_TEXT,
    COMM: "".join(f"c_{i} = {i}\n" for i in range(1, 31)),
    UT: "def flag():\n    return False\n",
}
Edit = tuple[str, str, str]  # (path, old text, new text)


def shifted(text: str, lines: int = 5) -> str:
    """`text` with `lines` new lines at the top: every later hunk moves."""
    return "".join(f"new_{i} = {i}\n" for i in range(lines)) + text


def edited(files: Mapping[str, str], *edits: Edit) -> dict[str, str]:
    result = dict(files)
    for path, old, new in edits:
        result[path] = edit(result[path], old, new)
    return result


@dataclass(frozen=True)
class RebaseFork:
    root: Path
    url: str

    def cli(self, *args: str, crash_at: str | None = None) -> subprocess.CompletedProcess[str]:
        """The CLI in a subprocess (as a person runs it; `crash_at` kills it there)."""
        env = {**os.environ, "PYTHONPATH": str(SCRIPTS)}
        env.pop(CRASH_ENV, None)
        if crash_at is not None:
            env[CRASH_ENV] = crash_at
        return subprocess.run(
            [sys.executable, "-m", "sm120fork", "-C", str(self.root), *args],
            env=env,
            capture_output=True,
            text=True,
            check=False,
        )

    def rebase(self, *args: str, crash_at: str | None = None) -> subprocess.CompletedProcess[str]:
        """`rebase ARGS --upstream-git <the remote>`."""
        return self.cli("rebase", *args, "--upstream-git", self.url, crash_at=crash_at)

    def report(self) -> dict[str, Any]:
        data: dict[str, Any] = json.loads((self.root / "build/rebase/report.json").read_text())
        return data

    def statuses(self) -> dict[str, str]:
        return {p["name"]: p["status"] for p in self.report()["patches"]}

    def read(self, path: str) -> str:
        return (self.root / path).read_text()

    def status(self) -> str:
        """`git status --porcelain`: empty when the checkout is exactly as committed."""
        return git_output("status", "--porcelain", "--untracked-files=all", cwd=self.root)

    def snapshot(self) -> dict[str, bytes]:
        """Every file outside .git and build/ with its bytes."""
        return {
            path.relative_to(self.root).as_posix(): path.read_bytes()
            for path in sorted(self.root.rglob("*"))
            if path.is_file() and path.relative_to(self.root).parts[0] not in (".git", "build")
        }


def make_rebase_fork(
    request: pytest.FixtureRequest,
    versions: Mapping[str, Mapping[str, str]],
    patches: Sequence[tuple[str, Sequence[Edit]]],
) -> RebaseFork:
    """Upstream tags `versions` (in that order) in a local git remote; a fork that
    imported the first of them, with one patch per (name, edits), each made
    against the tree the earlier ones leave. Hermetic git through the
    `make_upstream_git_repo` fixture; $SM120FORK_DATE is `DATE`."""
    tmp_path: Path = request.getfixturevalue("tmp_path")
    request.getfixturevalue("monkeypatch").setenv("SM120FORK_DATE", DATE)
    upstream = request.getfixturevalue("make_upstream_git_repo")(tmp_path, versions)
    url = upstream.as_uri()
    root = tmp_path / "fork"
    root.mkdir()
    git("init", "-q", ".", cwd=root)
    (root / ".gitignore").write_text("/build/\n")
    first = next(iter(versions))
    assert main(["-C", str(root), "import", first, "--upstream-git", url]) == 0
    tree = dict(versions[first])
    (root / "patches").mkdir()
    for name, edits in patches:
        changed = edited(tree, *edits)
        text = make_patch(name.removesuffix(".patch"), tree, {p: changed[p] for p, _, _ in edits})
        (root / "patches" / name).write_text(text)
        tree = changed
    (root / "patches" / "series").write_text("".join(f"{name}\n" for name, _ in patches))
    (root / "CHANGELOG.md").write_text(CHANGELOG)
    git("add", "-A", ".", cwd=root)
    git("commit", "-q", "-m", "fork at 0.5.9", cwd=root)
    return RebaseFork(root, url)
