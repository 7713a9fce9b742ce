"""The git boundary (subprocess; GitPython for the blob reader) and the diff records (unidiff)."""

from __future__ import annotations

from pathlib import Path

import pytest
from hermetic import git
from sm120fork import gitcmd
from sm120fork.errors import FatalError
from sm120fork.patches.diffs import DiffError, git_hunks, parse_diff


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    root = tmp_path / "repo"
    root.mkdir()
    git("init", "-q", ".", cwd=root)  # fixtures under the test seal (tests/hermetic.py)
    (root / "a b.py").write_text("one\n")
    (root / "two.py").write_text("two\n")
    git("add", "-A", ".", cwd=root)
    git("commit", "-q", "-m", "first", cwd=root)
    return root


def test_a_failure_names_command_exit_code_and_both_streams(repo: Path) -> None:
    with pytest.raises(gitcmd.GitError) as raised:
        gitcmd.run(["rev-parse", "--verify", "no-such-ref"], repo)
    message = raised.value.message
    assert message.startswith("`git rev-parse --verify no-such-ref` exited 128; stdout: -;")
    assert "stderr: fatal: Needed a single revision" in message


def test_unchecked_runs_keep_exact_bytes(repo: Path) -> None:
    result = gitcmd.run(["cat-file", "blob", "HEAD:two.py"], repo, check=False)
    assert (result.returncode, result.stdout) == (0, b"two\n")  # the final newline kept
    missing = gitcmd.run(["cat-file", "blob", "HEAD:none"], repo, check=False)
    assert missing.returncode == 128
    assert "path 'none' does not exist" in gitcmd.describe_failure(["cat-file"], missing)


def test_a_missing_directory_is_a_user_error(tmp_path: Path) -> None:
    with pytest.raises(FatalError, match="is not a directory"):
        gitcmd.run(["status"], tmp_path / "nowhere")


def test_object_reader_reads_many_blobs_through_one_process(repo: Path) -> None:
    with gitcmd.ObjectReader(repo) as objects:
        assert objects.read("HEAD:a b.py") == b"one\n"  # a space in the path
        assert objects.read("HEAD:none.py") is None
        assert objects.read("HEAD:two.py") == b"two\n"  # still answering after a miss
        assert objects.read("HEAD") is None  # a commit, not a blob
        process = objects._engine.cat_file_all
        assert process is not None
        for _ in range(20):
            objects.read("HEAD:two.py")
        assert objects._engine.cat_file_all is process  # the same `cat-file --batch`


NEW_AND_CHANGED = """\
diff --git a/x.py b/x.py
index 1111111..2222222 100644
--- a/x.py
+++ b/x.py
@@ -1,3 +1,3 @@ def f():
 a
-b
+c
 d
@@ -9 +9,2 @@
-last
\\ No newline at end of file
+last
+more
diff --git a/new.py b/new.py
new file mode 100644
--- /dev/null
+++ b/new.py
@@ -0,0 +1 @@
+x
"""


def test_records_keep_sections_counts_and_missing_newlines() -> None:
    changed, new = parse_diff(NEW_AND_CHANGED)
    assert (changed.path, changed.lineno, new.old_path, new.path, new.lineno) == (
        "x.py", 1, None, "new.py", 15,
    )  # fmt: skip
    first, second = changed.hunks
    assert (first.lineno, first.section, first.old_lines, first.new_lines) == (
        5, " def f():", ["a\n", "b\n", "d\n"], ["a\n", "c\n", "d\n"],
    )  # fmt: skip
    assert (second.old_count, second.new_count, second.old_lines) == (1, 2, ["last"])
    assert second.diff_lines == 5  # @@, three lines, one marker
    assert [(h.new_start, h.new_count) for h in git_hunks(NEW_AND_CHANGED)] == [
        (1, 3), (9, 2), (1, 1),
    ]  # fmt: skip


@pytest.mark.parametrize(
    ("text", "lineno", "fragment"),
    [
        ("diff --git a/x b/y\nsimilarity index 90%\nrename from x\n", 3, "renames and mode"),
        ("diff --git a/x b/x\nold mode 100644\nnew mode 100755\n", 2, "renames and mode"),
        ("diff --git a/x b/x\nBinary files a/x and b/x differ\n", 1, "binary patches"),
        ("--- a/x\n+++ b/x\n@@ -1,2 +1,2 @@\n-a\n+b\n", 3, "the patch is truncated"),
        ("--- a/x\n+++ b/x\n", 1, "has no hunks"),
        ("@@ -1 +1 @@\n-a\n+b\n", 1, "file header"),
        ("--- /x\n+++ b/x\n@@ -1 +1 @@\n-a\n+b\n", 1, "is absolute"),
        ("diff --git a/x b/x\n--- a/x\n+++ b/../x\n@@ -1 +1 @@\n-a\n+b\n", 3, "leaves the tree"),
        ("--- a/x\n+++ b/y\n@@ -1 +1 @@\n-a\n+b\n", 1, "renaming 'x' to 'y'"),
    ],
)
def test_policy_errors_name_the_line(text: str, lineno: int, fragment: str) -> None:
    with pytest.raises(DiffError) as raised:
        parse_diff(text, first_lineno=10)
    assert raised.value.lineno == lineno + 9
    assert fragment in raised.value.message
