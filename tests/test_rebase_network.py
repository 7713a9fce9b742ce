"""The real series, 0.5.9 -> 0.5.10 from the package index, as a dry run (network)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from rebasefork import SCRIPTS, RebaseFork
from sm120fork import gitcmd, lock
from sm120fork.series import read_series

PROJECT = SCRIPTS.parent
STATUSES = {"clean", "offset", "merged", "resolved", "upstreamed", "conflict"}


@pytest.mark.network
@pytest.mark.slow
def test_real_series_dry_run_onto_0_5_10(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    names = read_series(PROJECT / "patches/series").names
    pinned = lock.read(PROJECT / "vendor/sglang.lock")
    if not names or pinned is None or pinned.version != "0.5.9":
        pytest.skip("needs the fork's series on a vendored sglang 0.5.9")
    # Git without the user's config; pip keeps its own (HOME is untouched).
    for name, value in {
        "GIT_CONFIG_GLOBAL": "/dev/null",
        "GIT_CONFIG_NOSYSTEM": "1",
        "GIT_AUTHOR_NAME": "Test",
        "GIT_AUTHOR_EMAIL": "test@example.com",
        "GIT_COMMITTER_NAME": "Test",
        "GIT_COMMITTER_EMAIL": "test@example.com",
    }.items():
        monkeypatch.setenv(name, value)
    root = tmp_path / "fork"
    for part in ("vendor", "patches"):
        shutil.copytree(PROJECT / part, root / part)
    shutil.copy(PROJECT / "CHANGELOG.md", root / "CHANGELOG.md")
    (root / ".gitignore").write_text("/build/\n")
    gitcmd.run(["init", "-q", "."], root)
    gitcmd.run(["add", "-A", "."], root)
    gitcmd.run(["commit", "-q", "-m", "the fork"], root)
    fork = RebaseFork(root, "")
    before = fork.snapshot()

    result = fork.cli("rebase", "v0.5.10", "--dry-run")

    assert result.returncode in (0, 1), result.stderr
    report = fork.report()
    assert {k: report[k] for k in ("from", "to", "source", "result")} == {
        "from": "0.5.9",
        "to": "0.5.10",
        "source": "pypi",
        "result": "dry-run",
    }
    assert [p["name"] for p in report["patches"]] == list(names)
    for patch in report["patches"]:
        assert patch["status"] in STATUSES, patch
        assert patch["detail"], patch
        if patch["status"] == "conflict":
            assert patch["conflicts"], patch
    assert result.returncode == (
        1 if any(p["status"] == "conflict" for p in report["patches"]) else 0
    )
    assert fork.snapshot() == before
    assert fork.status() == ""
