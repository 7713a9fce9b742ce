"""The real series on the real vendored tree, carried onto a next release built from it.

No newer release than the pinned one need exist: the "next release" is the vendored
tree with every file the series touches shifted by an upstream comment block, served
from a local git remote (`--upstream-git`), so every patch must carry at shifted lines.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from hermetic import git
from rebasefork import SCRIPTS, RebaseFork
from sm120fork.patches.patchfile import parse_patch
from sm120fork.patches.series import read_series
from sm120fork.upstream import lock

PROJECT = SCRIPTS.parent
SHIFT = "# Upstream's next release adds a header here.\n" * 3


def _commit_tree(repo: Path, tree: Path, tag: str) -> None:
    for entry in repo.iterdir():
        if entry.name != ".git":
            shutil.rmtree(entry) if entry.is_dir() else entry.unlink()
    shutil.copytree(tree, repo, dirs_exist_ok=True)
    git("add", "-A", ".", cwd=repo)
    git("commit", "-q", "-m", tag, cwd=repo)
    git("tag", tag, cwd=repo)


@pytest.mark.slow
def test_real_series_carries_onto_a_shifted_next_release(tmp_path: Path) -> None:
    names = read_series(PROJECT / "patches/series").names
    pinned = lock.read(PROJECT / "vendor/sglang.lock")
    assert names and pinned is not None
    vendored = PROJECT / "vendor/sglang"
    changed = {  # per patch, the vendored files it changes (not those it creates)
        name: {
            file.path
            for file in parse_patch((PROJECT / "patches" / name).read_bytes(), name, 1).files
            if (vendored / file.path).is_file()
        }
        for name in names
    }
    touched = set().union(*changed.values())
    upstream = tmp_path / "upstream"
    upstream.mkdir()
    git("init", "-q", ".", cwd=upstream)
    _commit_tree(upstream, PROJECT / "vendor/sglang", f"v{pinned.version}")
    for path in touched:
        target = upstream / path
        target.write_text(SHIFT + target.read_text())
    next_version = "99.0.0"
    git("commit", "-q", "-a", "-m", "next", cwd=upstream)
    git("tag", f"v{next_version}", cwd=upstream)

    root = tmp_path / "fork"
    for part in ("vendor", "patches"):
        shutil.copytree(PROJECT / part, root / part)
    shutil.copy(PROJECT / "CHANGELOG.md", root / "CHANGELOG.md")
    (root / ".gitignore").write_text("/build/\n")
    git("init", "-q", ".", cwd=root)
    git("add", "-A", ".", cwd=root)
    git("commit", "-q", "-m", "the fork", cwd=root)
    fork = RebaseFork(root, str(upstream))
    before = fork.snapshot()

    result = fork.rebase(f"v{next_version}", "--dry-run")

    assert result.returncode == 0, result.stderr
    report = fork.report()
    assert (report["from"], report["to"], report["result"]) == (
        pinned.version,
        next_version,
        "dry-run",
    )
    assert [(p["name"], p["status"]) for p in report["patches"]] == [
        (name, "offset" if changed[name] else "clean") for name in names
    ]
    shifted = [p for p in report["patches"] if changed[p["name"]]]
    assert all("+3" in p["detail"] for p in shifted), report["patches"]
    assert fork.snapshot() == before
    assert fork.status() == ""
