"""`sm120fork import --upstream-git`: a release from a local git remote."""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import UPSTREAM_LICENSE, MakeUpstreamRepo, snapshot
from hermetic import git
from hermetic import output as git_output
from sm120fork.cli import main
from sm120fork.upstream import lock

V059: dict[str, str | bytes | None] = {
    "python/sglang/__init__.py": "__version__ = '0.5.9'\n",
    "python/sglang/srt/server_args.py": "def is_sm100_supported():\n    return False\n",
    "python/sglang/srt/logo.png": b"\x89PNG\r\n\x1a\n\x00\x00binary",
    "python/pyproject.toml": "[project]\nname = 'sglang'\n",  # outside the subtree
    "README.md": "upstream readme\n",
}
V0510: dict[str, str | bytes | None] = {
    "python/sglang/__init__.py": "__version__ = '0.5.10'\n",
    "python/sglang/srt/new_module.py": "X = 1\n",
}


@pytest.fixture(autouse=True)
def fixed_date(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(lock.DATE_ENV, "2026-02-03")


@pytest.fixture
def upstream(tmp_path: Path, make_upstream_git_repo: MakeUpstreamRepo) -> Path:
    return make_upstream_git_repo(tmp_path, {"v0.5.9": V059, "v0.5.10": V0510, "v0.4.0": {}})


def import_git(fork: Path, spec: str, url: Path | str) -> int:
    return main(["-C", str(fork), "import", spec, "--upstream-git", str(url)])


def test_import_lays_out_upstream_and_locks_the_commit(
    tmp_path: Path, upstream: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    fork = tmp_path / "fork"
    fork.mkdir()
    assert import_git(fork, "v0.5.9", upstream) == 0
    tree = fork / "vendor" / "sglang"
    files = sorted(p.relative_to(tree).as_posix() for p in tree.rglob("*") if p.is_file())
    assert files == ["LICENSE", "python/sglang/__init__.py", "python/sglang/srt/server_args.py"]
    assert (tree / "LICENSE").read_text() == UPSTREAM_LICENSE
    commit = git_output("rev-parse", "v0.5.9^{commit}", cwd=upstream)
    locked = lock.read(fork / "vendor" / "sglang.lock")
    assert locked == lock.Lock(
        version="0.5.9",
        tag="v0.5.9",
        source="git",
        imported="2026-02-03",
        tree_from=commit,
        license_from=f"{commit}:LICENSE",
        url=str(upstream),
        commit=commit,
        skipped=("python/sglang/srt/logo.png",),
    )
    assert not [p for p in fork.iterdir() if p.name.startswith(".sm120fork")]
    err = capsys.readouterr().err
    assert "fetching v0.5.9" in err


def test_reimport_replaces_the_tree(tmp_path: Path, upstream: Path) -> None:
    fork = tmp_path / "fork"
    fork.mkdir()
    assert import_git(fork, "0.5.9", upstream) == 0
    assert import_git(fork, "v0.5.x", upstream) == 0  # newest 0.5: 0.5.10
    tree = fork / "vendor" / "sglang"
    assert not (tree / "python/sglang/srt/server_args.py").exists()
    assert (tree / "python/sglang/srt/new_module.py").read_text() == "X = 1\n"
    assert lock.read(fork / "vendor" / "sglang.lock").tag == "v0.5.10"  # type: ignore[union-attr]


def test_latest_and_unknown_versions(
    tmp_path: Path, upstream: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    fork = tmp_path / "fork"
    fork.mkdir()
    assert import_git(fork, "latest", upstream) == 0
    assert lock.read(fork / "vendor" / "sglang.lock").version == "0.5.10"  # type: ignore[union-attr]
    capsys.readouterr()
    assert import_git(fork, "v0.5.11", upstream) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.endswith(
        f"sglang v0.5.11 is not a release at {upstream}; nearest releases: 0.5.10, 0.5.9"
    )


def test_moved_tag_is_refused_against_the_lock(tmp_path: Path, upstream: Path) -> None:
    fork = tmp_path / "fork"
    fork.mkdir()
    assert import_git(fork, "0.5.9", upstream) == 0
    before = snapshot(fork)
    git("tag", "-f", "-a", "-m", "moved", "v0.5.9", "v0.5.10", cwd=upstream)
    assert import_git(fork, "0.5.9", upstream) == 2
    assert snapshot(fork) == before


@pytest.mark.parametrize(
    ("files", "message"),
    [
        ({"LICENSE": None}, "has no top-level LICENSE"),
        ({"README.md": "no python tree\n"}, "has no python/sglang/"),
        ({"python/sglang/x.py": "x\n", "python/sglang/link.py": "SYMLINK"}, "is a symlink"),
    ],
)
def test_bad_tags_are_refused_and_vendor_is_untouched(
    tmp_path: Path,
    upstream: Path,
    files: dict[str, str | None],
    message: str,
    capsys: pytest.CaptureFixture[str],
) -> None:
    fork = tmp_path / "fork"
    fork.mkdir()
    assert import_git(fork, "0.5.9", upstream) == 0
    before = snapshot(fork)
    git("rm", "-r", "-q", ".", cwd=upstream)
    for path, content in {"LICENSE": UPSTREAM_LICENSE, **files}.items():
        if content is None:
            continue
        target = upstream / path
        target.parent.mkdir(parents=True, exist_ok=True)
        if content == "SYMLINK":
            target.symlink_to("../../etc/passwd")
        else:
            target.write_text(content)
    git("add", "-A", ".", cwd=upstream)
    git("commit", "-q", "-m", "bad", cwd=upstream)
    git("tag", "v0.5.12", cwd=upstream)
    capsys.readouterr()
    assert import_git(fork, "0.5.12", upstream) == 2
    assert message in capsys.readouterr().err
    assert snapshot(fork) == before


def test_unreachable_remote_is_a_one_line_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    fork = tmp_path / "fork"
    fork.mkdir()
    assert import_git(fork, "0.5.9", tmp_path / "nowhere") == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("sm120fork import: error: `git ls-remote")
    assert not (fork / "vendor").exists()


def test_credentials_are_not_written_into_the_lock() -> None:
    from sm120fork.upstream.git import public_url

    assert public_url("https://user:token@example.com/a/b.git") == "https://example.com/a/b.git"
    assert public_url("git@example.com:a/b.git") == "git@example.com:a/b.git"
