"""Synthetic upstream releases for the gate tests that rebase: a local git remote cut
from the pinned tree, and the tool and git run with a fixed identity and date."""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
GIT_ENV = {
    "GIT_CONFIG_NOSYSTEM": "1",
    "GIT_AUTHOR_NAME": "Upstream",
    "GIT_AUTHOR_EMAIL": "upstream@example.com",
    "GIT_COMMITTER_NAME": "Upstream",
    "GIT_COMMITTER_EMAIL": "upstream@example.com",
    "GIT_AUTHOR_DATE": "2026-01-02T03:04:05+00:00",
    "GIT_COMMITTER_DATE": "2026-01-02T03:04:05+00:00",
}

Edit = Callable[[Path], None]


def user_caches() -> dict[str, str]:
    """The user's gate-scan and intent-proof caches, which a test's fresh HOME would
    otherwise hide: their entries are named by the bytes they were made of and the
    tool's own source, so none can be stale (as in tests/hermetic.py)."""
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "sglang-sm120"
    return {
        "SM120FORK_GATE_SCAN_CACHE": os.environ.get("SM120FORK_GATE_SCAN_CACHE")
        or str(base / "gate-scan"),
        "SM120FORK_INTENT_CACHE": os.environ.get("SM120FORK_INTENT_CACHE")
        or str(base / "intent-proofs"),
    }


def run(
    cwd: Path, *args: str, home: Path, env: Mapping[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    merged = {**os.environ, **GIT_ENV, "HOME": str(home), "PYTHONPATH": str(ROOT / "scripts")}
    merged.update(user_caches())
    merged["SM120FORK_DATE"] = "2026-12-01"
    merged.update(env or {})
    return subprocess.run(args, cwd=cwd, env=merged, capture_output=True, text=True, check=False)


def git(cwd: Path, *args: str, home: Path) -> None:
    result = run(cwd, "git", *args, home=home)
    assert result.returncode == 0, result.stderr


def commit_all(repo: Path, message: str, home: Path) -> None:
    git(repo, "add", "-A", ".", home=home)
    git(repo, "commit", "-q", "-m", message, home=home)


def cut_releases(tmp: Path, home: Path, releases: Sequence[tuple[str, Edit | None]]) -> Path:
    """A git remote at `tmp/upstream`: vendor/sglang, then each (tag, edit) in order,
    the edit applied to the tree before the release is committed and tagged."""
    upstream = tmp / "upstream"
    shutil.copytree(ROOT / "vendor" / "sglang", upstream)
    git(upstream, "init", "-q", ".", home=home)
    for tag, edit in releases:
        if edit is not None:
            edit(upstream)
        commit_all(upstream, f"release {tag}", home)
        git(upstream, "tag", tag, home=home)
    return upstream
