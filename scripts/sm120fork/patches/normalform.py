"""The normal form of a patch: what `refresh` writes, so a no-op refresh is a no-op.

    <DEP-3 header, verbatim, trailing blank lines removed>
    ---
    <git diff -U3 --no-renames, myers, a/ b/ prefixes, without `index` lines>

No dates, no commit ids, no diffstat, files in git's path order. The diff is
made by git from the file contents before and after each patch, written as
commits into a scratch repository (`fast-import`, then `diff-tree`: two
processes for any number of patches), so it is the same wherever the tool runs.
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Sequence
from pathlib import Path
from types import TracebackType

from sm120fork import gitcmd
from sm120fork.patches.dep3 import Dep3Header
from sm120fork.patches.gitobjects import Files, write_commits
from sm120fork.patches.lines import split_lines

# Plumbing: `diff-tree` reads no diff.* configuration, so only what differs from
# its defaults is spelled out (myers, the a/ b/ prefixes of `git diff`).
_DIFF_OPTIONS = [
    "diff-tree", "--stdin", "--always", "-p", "--no-color", "--no-renames", "--no-ext-diff",
    "--no-textconv", "--diff-algorithm=myers", "-U3", "--src-prefix=a/", "--dst-prefix=b/",
]  # fmt: skip


def render_patch(header: Dep3Header, diff: str) -> bytes:
    return (header.raw.rstrip("\n") + "\n---\n" + diff).encode("utf-8")


class DiffRenderer:
    """Renders normal-form diffs; holds one scratch git repository for its lifetime."""

    def __init__(self) -> None:
        self._dir = Path(tempfile.mkdtemp(prefix="sm120fork-diff-"))
        gitcmd.run(["init", "-q", "--object-format=sha1", "."], self._dir)

    def __enter__(self) -> DiffRenderer:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def close(self) -> None:
        shutil.rmtree(self._dir, ignore_errors=True)

    def diff(self, before: Files, after: Files) -> str:
        """The normal-form diff turning `before` into `after` (None: file absent)."""
        return self.diff_many([(before, after)])[0]

    def diff_many(self, pairs: Sequence[tuple[Files, Files]]) -> list[str]:
        """The normal-form diff of every (before, after) pair (two git processes in all)."""
        if not pairs:
            return []
        ids = write_commits(self._dir, [side for pair in pairs for side in pair])
        # "<after> <before>": diff-tree compares a commit with the parents named after
        # it, and prints the commit's id before its diff (--always: also when empty).
        heads = ids[1::2]
        stdin = "".join(f"{new} {old}\n" for old, new in zip(ids[::2], heads, strict=True))
        out = gitcmd.run(_DIFF_OPTIONS, self._dir, input=stdin.encode()).stdout.decode("utf-8")
        # No diff line can equal a bare commit id (each starts with a prefix), so
        # reading the ids in order splits the output.
        diffs: list[list[str]] = []
        expected = iter(heads)
        upcoming = next(expected)
        for line in split_lines(out):
            if line.rstrip("\n") == upcoming:
                diffs.append([])
                upcoming = next(expected, "")
            elif not line.startswith("index "):
                diffs[-1].append(line)
        if len(diffs) != len(pairs):
            raise gitcmd.GitError(f"git diff-tree answered {len(diffs)} of {len(pairs)} pairs")
        return ["".join(lines) for lines in diffs]
