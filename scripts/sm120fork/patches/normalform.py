"""The normal form of a patch: what `refresh` writes, so a no-op refresh is a no-op.

    <DEP-3 header, verbatim, trailing blank lines removed>
    ---
    <git diff -U3 --no-renames, myers, a/ b/ prefixes, without `index` lines>

No dates, no commit ids, no diffstat, files in git's path order. The diff is
made by git from the file contents before and after the patch, in a scratch
repository, so it is the same wherever the tool runs.
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Mapping
from pathlib import Path
from types import TracebackType

from sm120fork import gitcmd
from sm120fork.patches.dep3 import Dep3Header
from sm120fork.patches.lines import split_lines

_DIFF_OPTIONS = [
    "-c", "diff.noprefix=false",
    "-c", "diff.mnemonicPrefix=false",
    "-c", "diff.relative=false",
    "-c", "diff.algorithm=myers",
    "diff", "--no-color", "--no-renames", "--no-ext-diff", "--no-textconv",
    "-U3", "--src-prefix=a/", "--dst-prefix=b/",
]  # fmt: skip


def render_patch(header: Dep3Header, diff: str) -> bytes:
    return (header.raw.rstrip("\n") + "\n---\n" + diff).encode("utf-8")


class DiffRenderer:
    """Renders normal-form diffs; holds one scratch git repository for its lifetime."""

    def __init__(self) -> None:
        self._dir = Path(tempfile.mkdtemp(prefix="sm120fork-diff-"))
        gitcmd.run(["init", "-q", "."], self._dir)

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

    def diff(self, before: Mapping[str, str | None], after: Mapping[str, str | None]) -> str:
        """The normal-form diff turning `before` into `after` (None: file absent)."""
        old_tree = self._tree(before)
        new_tree = self._tree(after)
        out = gitcmd.run([*_DIFF_OPTIONS, old_tree, new_tree], self._dir).stdout.decode("utf-8")
        return "".join(line for line in split_lines(out) if not line.startswith("index "))

    def _tree(self, files: Mapping[str, str | None]) -> str:
        for entry in self._dir.iterdir():
            if entry.name != ".git":
                shutil.rmtree(entry) if entry.is_dir() else entry.unlink()
        for path, text in files.items():
            if text is None:
                continue
            target = self._dir / path
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(text.encode("utf-8"))
        gitcmd.run(["add", "-A", "."], self._dir)
        return gitcmd.output(["write-tree"], self._dir)
