"""The two commits a review compares, and their files, read through git only.

Nothing here checks anything out: files come from `git cat-file --batch`
(one process for any number of blobs) and whole subtrees from `git archive`,
so the user's work tree is only ever looked at (`require_clean`).
"""

from __future__ import annotations

import io
import tarfile
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from sm120fork import gitcmd
from sm120fork.errors import FatalError

DEFAULT_BASES = ("origin/main", "main")
# What a review reads from the work tree's point of view: untracked files there count
# as dirt (a new patch not yet added), elsewhere they do not.
WATCHED = ("patches", "vendor", "gatetable")


@dataclass(frozen=True)
class Rev:
    ref: str  # as the user named it (or how the default was found)
    commit: str  # full object name

    @property
    def short(self) -> str:
        return self.commit[:12]


def _verify(root: Path, spec: str) -> str | None:
    """The object name `spec` stands for, None when it names nothing."""
    result = gitcmd.run(["rev-parse", "--verify", "--quiet", spec], root, check=False)
    return result.stdout.decode().strip() if result.returncode == 0 else None


def resolve(root: Path, ref: str) -> Rev:
    """The commit `ref` names; `main` also finds `origin/main` (a fresh clone has no main)."""
    if ref.startswith("-"):
        raise FatalError(f"unknown ref {ref!r}: a ref does not start with '-'")
    for candidate in (ref, f"origin/{ref}"):
        commit = _verify(root, f"{candidate}^{{commit}}")
        if commit is None:
            continue
        if candidate != ref:
            return Rev(f"{ref} ({candidate})", commit)
        if ref == "HEAD":  # say which branch
            branch = gitcmd.run(["symbolic-ref", "--short", "-q", "HEAD"], root, check=False)
            name = branch.stdout.decode().strip()
            return Rev(name if branch.returncode == 0 and name else ref, commit)
        return Rev(ref, commit)
    raise FatalError(
        f"unknown ref {ref!r}: no such commit, branch or tag; `git fetch` it or fix it"
    )


def default_base(root: Path, head: Rev) -> Rev:
    """The merge base of `head` with origin/main, else with main."""
    for branch in DEFAULT_BASES:
        if _verify(root, f"{branch}^{{commit}}") is None:
            continue
        merged = gitcmd.run(["merge-base", branch, head.commit], root, check=False)
        if merged.returncode == 0:
            return Rev(f"merge-base {branch}", merged.stdout.decode().strip())
    raise FatalError(
        "no BASE given and neither origin/main nor main shares history with HEAD; "
        "name the commit to review against"
    )


def require_ancestor(root: Path, base: Rev, head: Rev) -> None:
    result = gitcmd.run(
        ["merge-base", "--is-ancestor", base.commit, head.commit], root, check=False
    )
    if result.returncode == 1:
        raise FatalError(
            f"BASE {base.ref} is not an ancestor of {head.ref}; "
            f"review against `git merge-base {base.ref} {head.ref}`"
        )
    if result.returncode != 0:
        raise FatalError(gitcmd.describe_failure(["merge-base", "--is-ancestor"], result))


def require_clean(root: Path) -> None:
    """No tracked change anywhere, no untracked file where the review reads."""
    status = gitcmd.output(["status", "--porcelain=v1", "--untracked-files=all"], root)
    dirty = []
    for line in status.splitlines():
        path = line[3:]
        if not line.startswith("??") or path.startswith(tuple(f"{w}/" for w in WATCHED)):
            dirty.append(path)
    if dirty:
        more = f" and {len(dirty) - 1} more" if len(dirty) > 1 else ""
        raise FatalError(f"the work tree is dirty ({dirty[0]}{more}); commit or stash first")


def tree_id(root: Path, rev: Rev, path: str) -> str | None:
    """The object name of `path` at `rev` (a tree or a blob), None when absent."""
    return _verify(root, f"{rev.commit}:{path}")


def list_files(root: Path, rev: Rev, directory: str) -> tuple[str, ...]:
    out = gitcmd.output(["ls-tree", "-r", "--name-only", rev.commit, "--", directory], root)
    return tuple(out.splitlines())


def read_files(root: Path, rev: Rev, paths: Iterable[str]) -> dict[str, bytes | None]:
    """Each path's bytes at `rev` (None: no such file there), from one `git cat-file`."""
    with gitcmd.ObjectReader(root) as objects:
        return {path: objects.read(f"{rev.commit}:{path}") for path in dict.fromkeys(paths)}


def read_text(root: Path, rev: Rev, path: str) -> str | None:
    data = read_files(root, rev, [path])[path]
    if data is None:
        return None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as error:
        raise FatalError(f"{path} at {rev.ref} is not UTF-8 text; fix it there") from error


def extract(root: Path, rev: Rev, directory: str, dest: Path, *, suffix: str = "") -> None:
    """Write `directory` of `rev` (only files ending in `suffix`) under `dest`, paths kept."""
    spec = f":(glob){directory}/**/*{suffix}" if suffix else directory
    data = gitcmd.run(["archive", "--format=tar", rev.commit, "--", spec], root).stdout
    with tarfile.open(fileobj=io.BytesIO(data)) as archive:
        archive.extractall(dest, filter="data")
