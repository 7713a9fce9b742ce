"""Synthetic upstream releases for the gate tests that rebase: a local git remote cut
from the pinned tree, and the tool and git run with a fixed identity and date."""

from __future__ import annotations

import importlib.metadata
import os
import shutil
import subprocess
import sys
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


def decided_here() -> dict[str, str]:
    """The rebase's rows decided in this gate environment, found by its pins (the
    synthetic releases declare this environment's sglang's), and none installed."""
    return {"SM120_GATE_ENV": sys.prefix, "SM120_GATE_ENV_INSTALL": "no"}


def pyproject() -> str:
    """A `python/pyproject.toml` declaring the pins of the sglang installed here (the
    pinned release's: a synthetic release cut from it keeps them)."""
    requires = importlib.metadata.requires("sglang") or []
    listed = "".join(f"    {r!r},\n" for r in requires if "extra ==" not in r)
    return f'[project]\nname = "sglang"\ndependencies = [\n{listed}]\n'


def run(
    cwd: Path, *args: str, home: Path, env: Mapping[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    merged = {**os.environ, **GIT_ENV, "HOME": str(home), "PYTHONPATH": str(ROOT / "scripts")}
    merged.update(user_caches())
    merged.update(decided_here())
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
    """A git remote at `tmp/upstream`: vendor/sglang with its pins in
    python/pyproject.toml, then each (tag, edit) in order, the edit applied to the tree
    before the release is committed and tagged."""
    upstream = tmp / "upstream"
    shutil.copytree(ROOT / "vendor" / "sglang", upstream)
    (upstream / "python" / "pyproject.toml").write_text(pyproject())
    git(upstream, "init", "-q", ".", home=home)
    for tag, edit in releases:
        if edit is not None:
            edit(upstream)
        commit_all(upstream, f"release {tag}", home)
        git(upstream, "tag", tag, home=home)
    return upstream


def fork_checkout(tmp: Path, home: Path) -> Path:
    """A git checkout of the fork as it is (vendor/, patches/, gatetable/, tests/), at
    `tmp/fork`."""
    fork = tmp / "fork"
    fork.mkdir()
    for name in ("vendor", "patches", "gatetable", "tests", "pyproject.toml", "CHANGELOG.md"):
        source = ROOT / name
        ignore = shutil.ignore_patterns("__pycache__")
        if source.is_dir():
            shutil.copytree(source, fork / name, ignore=ignore)
        else:
            shutil.copy(source, fork / name)
    (fork / ".gitignore").write_text("/build/\n__pycache__/\n")
    git(fork, "init", "-q", ".", home=home)
    commit_all(fork, "the fork at its pinned release", home)
    return fork
