"""The work repository's commits made without reading the files again (issue 20): a
release from the git objects that hold it, the series in one fast-import, a carried
patch committed through the files it wrote. Each is the very commit the reading
route makes, and each falls back to that route where the objects are not the files."""

from __future__ import annotations

import stat
from pathlib import Path

import hermetic
import pytest
from conftest import MakeUpstreamRepo
from sm120fork import gitcmd
from sm120fork.paths import RepoPaths
from sm120fork.rebase import releasecommits
from sm120fork.rebase.workrepo import WorkRepo
from sm120fork.upstream import git as upstream_git
from sm120fork.upstream import lock

FILES = {
    "LICENSE": "Apache-2.0\n",
    "python/sglang/__init__.py": "",
    "python/sglang/srt/server_args.py": "x = 1\n",
    "python/sglang/srt/run.sh": "#!/bin/sh\n",
}


def _write_tree(root: Path) -> Path:
    for path, text in FILES.items():
        (root / path).parent.mkdir(parents=True, exist_ok=True)
        (root / path).write_text(text)
    script = root / "python/sglang/srt/run.sh"
    script.chmod(script.stat().st_mode | stat.S_IXUSR)
    (root / "python/sglang/link.py").symlink_to("srt/server_args.py")
    return root


def _fork(tmp: Path) -> RepoPaths:
    """A fork repository whose vendor/sglang is committed."""
    root = tmp / "fork"
    _write_tree(root / "vendor" / "sglang")
    (root / ".gitignore").write_text("__pycache__/\n")
    hermetic.git("init", "-q", ".", cwd=root)
    hermetic.git("add", "-A", ".", cwd=root)
    hermetic.git("commit", "-q", "-m", "fork", cwd=root)
    return RepoPaths(root)


def _staged(tree: Path) -> dict[str, gitcmd.Blob]:
    """`tree` made a git repository with every file staged (its blobs written): the
    files as `commit_known` is told them."""
    hermetic.git("init", "-q", ".", cwd=tree)
    hermetic.git("add", "-A", ".", cwd=tree)
    written = hermetic.output("write-tree", cwd=tree)
    listing = hermetic.git("ls-tree", "-r", "-l", "-z", written, cwd=tree).stdout
    known = gitcmd.listed_blobs(listing.encode("utf-8", "surrogateescape"))
    assert known is not None
    return known


def _alternates(repo: WorkRepo) -> str:
    path = repo.root / ".git" / "objects" / "info" / "alternates"
    return path.read_text() if path.is_file() else ""


def test_the_pinned_tree_is_committed_from_the_forks_objects(tmp_path: Path) -> None:
    paths = _fork(tmp_path)
    by_reading = WorkRepo.create(tmp_path / "read").commit_dir(paths.upstream_tree, None, "m")
    repo = WorkRepo.create(tmp_path / "work")
    assert releasecommits.commit_pinned(repo, paths, "m") == by_reading
    assert _alternates(repo).strip().endswith("objects")


@pytest.mark.parametrize("change", ["edited", "untracked", "ignored"])
def test_a_pinned_tree_unlike_head_is_committed_as_it_is_on_disk(
    tmp_path: Path, change: str
) -> None:
    """Whatever is in vendor/sglang but not in HEAD is committed, as commit_dir does."""
    paths = _fork(tmp_path)
    package = paths.upstream_tree / "python" / "sglang"
    if change == "edited":
        (package / "srt" / "server_args.py").write_text("x = 2\n")  # same size as before
    elif change == "untracked":
        (package / "new.py").write_text("y = 1\n")
    else:
        (package / "__pycache__").mkdir()
        (package / "__pycache__" / "x.pyc").write_bytes(b"\0")
    by_reading = WorkRepo.create(tmp_path / "read").commit_dir(paths.upstream_tree, None, "m")
    repo = WorkRepo.create(tmp_path / "work")
    assert releasecommits.commit_pinned(repo, paths, "m") == by_reading
    assert _alternates(repo) == ""


def test_a_pinned_tree_outside_a_git_repository_is_read(tmp_path: Path) -> None:
    root = tmp_path / "plain"
    _write_tree(root / "vendor" / "sglang")
    paths = RepoPaths(root)
    by_reading = WorkRepo.create(tmp_path / "read").commit_dir(paths.upstream_tree, None, "m")
    assert releasecommits.commit_pinned(WorkRepo.create(tmp_path / "w"), paths, "m") == by_reading


def _fetched(tmp: Path, make_upstream_git_repo: MakeUpstreamRepo) -> tuple[Path, str]:
    """A release fetched from git as the rebase fetches it: (release dir, its lock)."""
    files = {path: text for path, text in FILES.items() if path != "LICENSE"}
    files["python/sglang/logo.png"] = "\x89PNG\0binary"  # skipped: not text
    remote = make_upstream_git_repo(tmp, {"v0.5.24": files})
    release = tmp / "release"
    release.mkdir()
    fetched = upstream_git.fetch_tree(remote.as_uri(), "v0.5.24", release, release / "tree")
    assert fetched.skipped == ("python/sglang/logo.png",)
    text = lock.dumps(
        lock.Lock(
            version="0.5.24",
            tag="v0.5.24",
            source="git",
            imported="2026-12-02",
            tree_from=fetched.commit,
            license_from=f"{fetched.commit}:LICENSE",
            url=remote.as_uri(),
            commit=fetched.commit,
        )
    )
    return release, text


def test_a_release_fetched_from_git_is_committed_from_its_objects(
    tmp_path: Path, make_upstream_git_repo: MakeUpstreamRepo
) -> None:
    release, text = _fetched(tmp_path, make_upstream_git_repo)
    tree = release / "tree"
    reading = WorkRepo.create(tmp_path / "read")
    base = reading.commit_dir(tree, None, "base")
    by_reading = reading.commit_dir(tree, base, "sglang 0.5.24")
    repo = WorkRepo.create(tmp_path / "work")
    assert repo.commit_dir(tree, None, "base") == base
    assert releasecommits.commit_fetched(repo, tree, release, text, base, "sglang 0.5.24") == (
        by_reading
    )
    assert "upstream.git" in _alternates(repo)


def test_a_fetched_release_changed_on_disk_is_read(
    tmp_path: Path, make_upstream_git_repo: MakeUpstreamRepo
) -> None:
    release, text = _fetched(tmp_path, make_upstream_git_repo)
    tree = release / "tree"
    (tree / "python/sglang/srt/server_args.py").write_text("x = 10\n")
    by_reading = WorkRepo.create(tmp_path / "read").commit_dir(tree, None, "m")
    repo = WorkRepo.create(tmp_path / "work")
    assert releasecommits.commit_fetched(repo, tree, release, text, "", "m") == by_reading


def test_commit_known_refuses_what_the_objects_do_not_hold(tmp_path: Path) -> None:
    tree = _write_tree(tmp_path / "tree")
    known = _staged(tree)
    assert set(known) == {*FILES, "python/sglang/link.py"}
    repo = WorkRepo.create(tmp_path / "work")
    repo.borrow_objects(tree / ".git" / "objects")
    (tree / "python/sglang/new.py").write_text("")
    assert repo.commit_known(tree, known, None, "m") is None  # a file it does not know
    (tree / "python/sglang/new.py").unlink()
    (tree / "python/sglang/srt/run.sh").chmod(0o644)
    assert repo.commit_known(tree, known, None, "m") is None  # another mode
    (tree / "python/sglang/srt/run.sh").chmod(0o755)
    missing = {**known, "LICENSE": known["LICENSE"]._replace(oid="0" * 40)}
    assert repo.commit_known(tree, missing, None, "m") is None  # a blob nowhere
    assert repo.commit_known(tree, known, None, "m") == WorkRepo.create(
        tmp_path / "read"
    ).commit_dir(tree, None, "m")


def test_the_series_in_one_fast_import_is_each_commit_in_turn(tmp_path: Path) -> None:
    tree = _write_tree(tmp_path / "tree")
    series: list[tuple[str, dict[str, str | None]]] = [
        ("a.patch", {"LICENSE": "MIT\n", "python/sglang/new.py": "n = 1\n"}),
        ("b.patch", {"python/sglang/new.py": None, "python/sglang/srt/run.sh": "#!/bin/sh\n:\n"}),
        ("c.patch", {"python/sglang/new.py": "n = 2\n"}),  # re-created: a new file again
    ]
    one = WorkRepo.create(tmp_path / "one")
    base = one.commit_dir(tree, None, "base")
    together = one.commit_series(base, series)
    each = WorkRepo.create(tmp_path / "each")
    tip = each.commit_dir(tree, None, "base")
    in_turn = []
    for message, changes in series:
        tip = each.commit_changes(tip, message, changes)
        in_turn.append(tip)
    assert together == in_turn
    assert "100755 blob" in one.out("ls-tree", together[-1], "python/sglang/srt/run.sh")


def test_a_worktree_committed_through_its_paths_is_the_whole_worktree_commit(
    tmp_path: Path,
) -> None:
    tree = _write_tree(tmp_path / "tree")
    commits = []
    for name, paths in (("all", None), ("named", ("python/sglang/__init__.py", "LICENSE"))):
        repo = WorkRepo.create(tmp_path / name)
        repo.checkout(repo.commit_dir(tree, None, "base"))
        (repo.root / "python/sglang/__init__.py").write_text("import os\n")
        (repo.root / "LICENSE").unlink()
        commits.append(repo.commit_worktree("sm120-a.patch", paths))
        assert repo.dirty_paths() == []
        assert repo.commit_worktree("again", paths) is None  # nothing left to commit
    assert commits[0] == commits[1] and commits[0] is not None


def test_a_store_borrowed_while_files_are_being_read_is_read_too(tmp_path: Path) -> None:
    """The next release's store is borrowed while the work repository's reader of the
    release before is running (a `rebase --step`): its files must be found."""
    first, second = tmp_path / "first", tmp_path / "second"
    for store, text in ((first, "x = 1\n"), (second, "x = 2\n")):
        (store / "python").mkdir(parents=True)
        (store / "python" / "mod.py").write_text(text)
    repo = WorkRepo.create(tmp_path / "work")
    commits: list[str] = []
    for store in (first, second):
        known = _staged(store)
        repo.borrow_objects(store / ".git" / "objects")
        commit = repo.commit_known(store, known, commits[-1] if commits else None, "m")
        assert commit is not None
        commits.append(commit)
        assert repo.read(commit, "python/mod.py") == (store / "python" / "mod.py").read_text()
