"""The tool's git is its own: a user's hostile ~/.gitconfig, or GIT_* variables left by
a hook, change neither a patch's normal form nor a rebase, nor the user's repository."""

from __future__ import annotations

from pathlib import Path

import pytest
from forkrepo import BASE_FILES, edit, make_fork, make_patch
from hermetic import git
from rebasefork import BASE, SA, make_rebase_fork, shifted
from sm120fork.cli import main

TWO_HUNKS = make_patch(
    "two changes twenty lines apart",
    BASE_FILES,
    {
        "python/sglang/srt/server_args.py": edit(
            edit(BASE_FILES["python/sglang/srt/server_args.py"], "line 10\n", "line ten\n"),
            "line 30\n",
            "line thirty\n",
        )
    },
)


def hostile_config(tmp_path: Path) -> Path:
    """What a user may well have: each line would change the tool's git output or commits."""
    hooks = tmp_path / "hooks"
    hooks.mkdir()
    (hooks / "pre-commit").write_text("#!/bin/sh\necho hostile hook >&2\nexit 1\n")
    (hooks / "pre-commit").chmod(0o755)
    (tmp_path / "template.txt").write_text("a commit template line\n")
    config = tmp_path / "hostile.gitconfig"
    config.write_text(
        "[diff]\n\tinterHunkContext = 100\n\tnoprefix = true\n\tcontext = 10\n"
        "\talgorithm = patience\n\tmnemonicPrefix = true\n"
        "[core]\n\tautocrlf = true\n\thooksPath = " + str(hooks) + "\n"
        "[commit]\n\tgpgsign = true\n\ttemplate = " + str(tmp_path / "template.txt") + "\n"
        "[gpg]\n\tprogram = /bin/false\n[color]\n\tui = always\n[init]\n\tdefaultBranch = trunk\n"
    )
    return config


def test_a_hostile_global_config_changes_no_normal_form(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    fork = make_fork(tmp_path / "fork", {"0001-two.patch": TWO_HUNKS})
    assert TWO_HUNKS.count("\n@@ ") == 2
    monkeypatch.setenv("GIT_CONFIG_GLOBAL", str(hostile_config(tmp_path)))
    assert main(["-C", str(fork), "check"]) == 0, capsys.readouterr().out
    assert main(["-C", str(fork), "refresh"]) == 0
    assert (fork / "patches/0001-two.patch").read_text() == TWO_HUNKS


def test_a_hook_s_git_variables_do_not_reach_the_scratch_repositories(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # As in a pre-commit hook of another repository: its GIT_DIR and GIT_INDEX_FILE.
    decoy = tmp_path / "decoy"
    decoy.mkdir()
    git("init", "-q", ".", cwd=decoy)
    fork = make_fork(tmp_path / "fork", {"0001-two.patch": TWO_HUNKS})
    monkeypatch.setenv("GIT_DIR", str(decoy / ".git"))
    monkeypatch.setenv("GIT_INDEX_FILE", str(decoy / ".git" / "index"))
    monkeypatch.setenv("GIT_WORK_TREE", str(decoy))
    assert main(["-C", str(fork), "check"]) == 0, capsys.readouterr().out
    monkeypatch.delenv("GIT_DIR")
    monkeypatch.delenv("GIT_INDEX_FILE")
    monkeypatch.delenv("GIT_WORK_TREE")
    assert not (decoy / ".git" / "index").exists()  # nothing was ever added there
    assert git("count-objects", cwd=decoy).stdout.startswith("0 objects")


def test_a_rebase_under_a_hostile_global_config(
    request: pytest.FixtureRequest, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    after = {**BASE, SA: shifted(BASE[SA])}
    fork = make_rebase_fork(
        request,
        {"v0.5.9": BASE, "v0.5.10": after},
        [
            (
                "0001-gate.patch",
                [(SA, "x_25 = 25\n", "x_25 = 'fork'\n"), (SA, "x_50 = 50\n", "x_50 = 'fork'\n")],
            )
        ],
    )
    monkeypatch.setenv("GIT_CONFIG_GLOBAL", str(hostile_config(tmp_path)))
    result = fork.rebase("v0.5.10")
    assert result.returncode == 0, result.stderr
    assert fork.statuses() == {"0001-gate.patch": "offset"}
    patch = fork.read("patches/0001-gate.patch")
    assert "--- a/python/sglang/srt/server_args.py" in patch and "\x1b[" not in patch
    assert patch.count("\n@@ ") == 2  # refreshed at the new lines, hunks kept apart
