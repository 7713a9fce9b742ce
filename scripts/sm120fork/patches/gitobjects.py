"""File sets written into a scratch repository as commits, all through one process.

The normal-form renderer needs a git tree for each side of every patch; `git add`
plus `git write-tree` cost two processes a tree (about 20 ms a patch). One
`git fast-import` takes any number of them as a stream and writes one pack.
Each file set becomes a parentless commit (fixed author and date, so equal sets
give equal ids); only regular files (mode 100644) are written: all a patch's
text files can be.
"""

from __future__ import annotations

import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path

from sm120fork import gitcmd

Files = Mapping[str, str | None]
_REF = b"refs/heads/sm120fork-scratch"
_COMMIT = b"committer sm120fork <sm120fork@localhost> 0 +0000\ndata 0\n"


def _quoted(path: str) -> bytes:
    # fast-import reads a path starting with '"' as C-quoted; quoting always is exact.
    escaped = path.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
    return b'"' + escaped.encode("utf-8") + b'"'


def _stream(sides: Sequence[Files]) -> bytes:
    parts: list[bytes] = []
    for mark, files in enumerate(sides, start=1):
        parts += [b"reset ", _REF, b"\ncommit ", _REF, b"\nmark :%d\n" % mark, _COMMIT]
        for path, text in sorted(files.items()):
            if text is None:
                continue
            data = text.encode("utf-8")
            parts += [b"M 100644 inline ", _quoted(path), b"\ndata %d\n" % len(data), data, b"\n"]
        parts.append(b"\n")
    return b"".join(parts)


def write_commits(repo: Path, sides: Sequence[Files]) -> list[str]:
    """The commit id holding each file set (path -> text; None: absent), in order."""
    if not sides:
        return []
    with tempfile.TemporaryDirectory(prefix="sm120fork-marks-") as tmp:
        marks = Path(tmp) / "marks"
        gitcmd.run(
            ["fast-import", "--quiet", "--force", f"--export-marks={marks}"],
            repo,
            input=_stream(sides),
        )
        ids = dict(line.split(" ", 1) for line in marks.read_text().splitlines())
    return [ids[f":{mark}"] for mark in range(1, len(sides) + 1)]
