"""The work repository's commits: the series in one fast-import is each commit in
turn, and a carried patch committed through the files it wrote is the whole work
tree's commit."""

from __future__ import annotations

import stat
from pathlib import Path

from sm120fork.rebase.workrepo import WorkRepo

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
