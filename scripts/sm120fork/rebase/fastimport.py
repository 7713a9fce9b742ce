"""Commits for the scratch repository written by `git fast-import`: one pack for a
whole release (5700 files) instead of a loose object per file, with the work
repository's fixed identity and date, so a commit's id is the one `git commit`
would give it.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

IDENTITY = {
    "GIT_AUTHOR_NAME": "sm120fork rebase",
    "GIT_AUTHOR_EMAIL": "rebase@sm120fork.invalid",
    "GIT_AUTHOR_DATE": "2000-01-01T00:00:00+00:00",
    "GIT_COMMITTER_NAME": "sm120fork rebase",
    "GIT_COMMITTER_EMAIL": "rebase@sm120fork.invalid",
    "GIT_COMMITTER_DATE": "2000-01-01T00:00:00+00:00",
}
_EPOCH = 946684800  # the identity's date, 2000-01-01T00:00:00+00:00
_SCRATCH_REF = b"refs/sm120fork/commit-dir"

Listed = tuple[bytes, bytes, bytes | None, bytes, int]  # path, mode, link target, file, size


def quoted(path: bytes) -> bytes:
    # fast-import reads a path starting with '"' as C-quoted; quoting always is exact.
    return b'"' + path.replace(b"\\", b"\\\\").replace(b'"', b'\\"').replace(b"\n", b"\\n") + b'"'


def listed(tree: Path) -> list[Listed]:
    """Every file and link of `tree` as `git add` sees them (the owner's execute bit, a
    link's target; no `.git` inside), without reading a file."""
    found: list[Listed] = []
    pending = [(os.fsencode(tree), b"")]
    while pending:
        folder, rel = pending.pop()
        with os.scandir(folder) as entries:
            for entry in entries:
                path = rel + entry.name
                if entry.is_symlink():
                    target = os.fsencode(Path(os.fsdecode(entry.path)).readlink())
                    found.append((path, b"120000", target, b"", len(target)))
                elif entry.is_dir():
                    if entry.name != b".git":
                        pending.append((entry.path, path + b"/"))
                elif entry.is_file():
                    info = entry.stat(follow_symlinks=False)
                    mode = b"100755" if info.st_mode & stat.S_IXUSR else b"100644"
                    found.append((path, mode, None, entry.path, info.st_size))
                # a fifo or socket: git add skips it too
    return found


def file_commands(tree: Path) -> list[bytes]:
    """fast-import's `M` command for every file and link of `tree`, data inline. The
    files are read on a few threads: opening 5700 files is mostly waiting on the disk."""
    found = listed(tree)
    with ThreadPoolExecutor(max_workers=8) as pool:
        datas = pool.map(_read_or_link, found)
        commands: list[bytes] = []
        for (path, mode, _, _, _), data in zip(found, datas, strict=True):
            commands += [b"M ", mode, b" inline ", quoted(path)]
            commands += [b"\ndata %d\n" % len(data), data, b"\n"]
    return commands


def _read_or_link(item: Listed) -> bytes:
    _, _, link_target, file, _ = item
    if link_target is not None:
        return link_target
    with open(file, "rb") as handle:
        return handle.read()


def commit_command(mark: int, message: str, parent: str | None, files: list[bytes]) -> bytes:
    """fast-import's `commit` of `files` on `parent` (a commit id or `:mark`)."""
    head = [b"commit ", _SCRATCH_REF, b"\nmark :%d\n" % mark]
    for who in ("AUTHOR", "COMMITTER"):
        name, email = IDENTITY[f"GIT_{who}_NAME"], IDENTITY[f"GIT_{who}_EMAIL"]
        head.append(f"{who.lower()} {name} <{email}> {_EPOCH} +0000\n".encode())
    text = (message + "\n").encode("utf-8")
    head += [b"data %d\n" % len(text), text]
    if parent:
        head.append(f"from {parent}\n".encode())
    return b"".join([*head, *files, b"\n"])


def run(git: Callable[..., object], git_dir: Path, commits: list[bytes]) -> list[str]:
    """Run fast-import (through `git`, the repository's runner) on `commits`, marked
    1..n: their ids, in mark order."""
    marks = git_dir / "sm120fork-commit-dir.marks"
    stream = b"".join([b"reset ", _SCRATCH_REF, b"\n", *commits])
    # No deltas, light compression: a scratch pack, written once and thrown away
    # (for a release, 1 s and 22 MB; with fast-import's deltas, 2.1 s and 20 MB).
    fast_import = ["-c", "core.compression=1", "fast-import", "--quiet", "--force", "--depth=0"]
    git(*fast_import, f"--export-marks={marks}", input=stream)
    marked = dict(line.split() for line in marks.read_text().splitlines())
    marks.unlink()
    return [marked[f":{number}"] for number in range(1, len(commits) + 1)]
