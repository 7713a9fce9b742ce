"""The batched git writes of issue 20: the normal form of many patches from two git
processes, and a tree committed through `git fast-import`, each byte-identical to
the process-a-step route they replaced."""

from __future__ import annotations

import stat
import subprocess
from pathlib import Path

import hermetic
from sm120fork.patches.normalform import DiffRenderer
from sm120fork.rebase.workrepo import WorkRepo


def git(cwd: Path, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return hermetic.git(*args, cwd=cwd, check=check)


OLD = "".join(f"line {k}\n" for k in range(40))
NEW = OLD.replace("line 20\n", "line 20\nadded\n")


def _by_git_diff(tmp: Path, before: dict[str, str | None], after: dict[str, str | None]) -> str:
    """`git diff` of two trees written with `git add` (the renderer's route before)."""
    trees = []
    for side, files in (("a", before), ("b", after)):
        root = tmp / side
        for path, text in files.items():
            if text is not None:
                (root / path).parent.mkdir(parents=True, exist_ok=True)
                (root / path).write_text(text)
        root.mkdir(exist_ok=True)
        git(tmp, "--work-tree", str(root), "add", "-A", ".")
        trees.append(git(tmp, "write-tree").stdout.strip())
        git(tmp, "rm", "-q", "-r", "--cached", ".", check=False)
    diff = git(tmp, "diff", "--no-renames", "-U3", *trees).stdout
    return "".join(line for line in diff.splitlines(keepends=True) if not line.startswith("index "))


def test_many_diffs_at_once_equal_each_alone(tmp_path: Path) -> None:
    pairs: list[tuple[dict[str, str | None], dict[str, str | None]]] = [
        ({"python/a.py": OLD}, {"python/a.py": NEW}),
        ({"b.py": OLD}, {"b.py": OLD}),  # no change: an empty diff, kept in its place
        ({"c.py": None}, {"c.py": "new file\n"}),
        ({"d/e.py": "gone\n"}, {"d/e.py": None}),
        ({}, {}),
        ({"f.py": "no newline"}, {"f.py": "no newline at all"}),
        ({"python/a.py": OLD}, {"python/a.py": NEW}),  # the same pair twice
    ]
    with DiffRenderer() as renderer:
        together = renderer.diff_many(pairs)
        alone = [renderer.diff(before, after) for before, after in pairs]
    assert together == alone
    assert together[1] == together[4] == ""
    assert together[0] == together[6] and "+added\n" in together[0]
    git(tmp_path, "init", "-q", ".")
    for k, (before, after) in enumerate(pairs[:4]):
        (tmp_path / str(k)).mkdir()
        assert together[k] == _by_git_diff(tmp_path / str(k), before, after)


def test_a_tree_committed_by_fast_import_is_the_tree_git_add_writes(tmp_path: Path) -> None:
    tree = tmp_path / "tree"
    (tree / "pkg" / "deep").mkdir(parents=True)
    (tree / "pkg" / "mod.py").write_text("x = 1\n")
    (tree / "pkg" / "deep" / 'odd "name".py').write_text("y = 2\n")
    (tree / "run.sh").write_text("#!/bin/sh\n")
    (tree / "run.sh").chmod((tree / "run.sh").stat().st_mode | stat.S_IXUSR)
    (tree / "empty.txt").write_bytes(b"")
    (tree / "link.py").symlink_to("pkg/mod.py")
    repo = WorkRepo.create(tmp_path / "work")
    first = repo.commit_dir(tree, None, "first")
    (tree / "pkg" / "mod.py").unlink()
    second = repo.commit_dir(tree, first, "second")

    git(tmp_path, "init", "-q", "by-add")
    by_add = tmp_path / "by-add"
    git(by_add, "--work-tree", str(tree), "add", "-A", "-f", ".")
    assert repo.out("rev-parse", f"{second}^{{tree}}") == git(by_add, "write-tree").stdout.strip()
    assert repo.out("rev-parse", f"{second}^") == first
    assert "pkg/mod.py" in repo.out("ls-tree", "-r", "--name-only", first)
    assert "pkg/mod.py" not in repo.out("ls-tree", "-r", "--name-only", second)
    assert repo.out("log", "-1", "--format=%an %ad %s", "--date=unix", second) == (
        "sm120fork rebase 946684800 second"
    )


def test_changes_committed_in_memory_are_the_commit_git_makes_of_them(tmp_path: Path) -> None:
    """`commit_changes` (the rebase's prepare) gives the very commit that writing the
    changes to the work tree and `commit_worktree` give: a changed file keeps its mode
    (an executable one too), a new file is 100644, a deleted one is gone."""
    tree = tmp_path / "tree"
    (tree / "pkg").mkdir(parents=True)
    (tree / "pkg" / "mod.py").write_text("x = 1\n")
    (tree / "pkg" / "gone.py").write_text("y = 2\n")
    (tree / "run.sh").write_text("#!/bin/sh\n")
    (tree / "run.sh").chmod((tree / "run.sh").stat().st_mode | stat.S_IXUSR)
    repo = WorkRepo.create(tmp_path / "work")
    base = repo.commit_dir(tree, None, "sglang 0.5.23")
    changes: dict[str, str | None] = {
        "pkg/mod.py": "x = 2\n",
        "pkg/gone.py": None,
        "pkg/new.py": "z = 3\n",
        "run.sh": "#!/bin/sh\necho sm120\n",
    }
    in_memory = repo.commit_changes(base, "sm120-a.patch", changes)

    repo.checkout(base)
    for path, text in changes.items():
        if text is None:
            (repo.root / path).unlink()
        else:
            (repo.root / path).write_text(text)
    assert repo.commit_worktree("sm120-a.patch") == in_memory
    assert "100755 blob" in repo.out("ls-tree", in_memory, "run.sh")
