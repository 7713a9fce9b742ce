"""The fork's own series on the vendored tree, through the standard tools.

docs/contract.md: the series applies with GNU `quilt push -a` and with `git apply` in
order, with no offset and no fuzz, and each patch is `git am`-able upstream.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest
from hermetic import git as sealed_git
from sm120fork.patches.series import read_series
from sm120fork.paths import RepoPaths

ROOT = Path(__file__).resolve().parents[1]
PATHS = RepoPaths(ROOT)
NAMES = read_series(PATHS.series_file).names


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    copy = tmp_path / "sglang"
    shutil.copytree(PATHS.upstream_tree, copy)
    return copy


def test_the_series_is_not_empty() -> None:
    assert NAMES, "patches/series lists no patch"


@pytest.mark.skipif(shutil.which("quilt") is None, reason="GNU quilt is not installed")
def test_quilt_push_all_applies_without_offset_or_fuzz(tree: Path) -> None:
    env = {**os.environ, "QUILT_PATCHES": str(PATHS.patches_dir), "QUILTRC": "/dev/null"}
    result = subprocess.run(
        ["quilt", "push", "-a"], cwd=tree, env=env, capture_output=True, text=True, check=False
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.count("Applying patch") == len(NAMES)
    assert "offset" not in result.stdout and "fuzz" not in result.stdout, result.stdout


def test_git_apply_in_order_and_git_am_upstream(tree: Path) -> None:
    def git(*args: str) -> subprocess.CompletedProcess[str]:
        return sealed_git(*args, cwd=tree, check=False)

    assert git("init", "-q", ".").returncode == 0
    assert git("add", "-A", ".").returncode == 0
    assert git("commit", "-q", "-m", "upstream 0.5.9").returncode == 0
    for name in NAMES:  # exact: no offset allowed (-C3 keeps the full context)
        checked = git("apply", "--check", "-C3", "--verbose", str(PATHS.patches_dir / name))
        assert checked.returncode == 0, checked.stderr
        assert "offset" not in checked.stderr, checked.stderr
        applied = git("am", str(PATHS.patches_dir / name))
        assert applied.returncode == 0, applied.stdout + applied.stderr
    subjects = git("log", "--reverse", "--format=%s", f"-{len(NAMES)}").stdout.splitlines()
    assert len(subjects) == len(NAMES)
