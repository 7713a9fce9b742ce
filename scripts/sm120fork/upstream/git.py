"""Upstream releases from a git remote: tag `vX.Y.Z`, subtree `python/sglang`, `LICENSE`.

Blobs are read with `ls-tree` + `cat-file --batch` rather than `git archive`,
because upstream `.gitattributes` (export-ignore, export-subst) would make an
archive differ from the commit. Everything goes through `gitcmd`.
"""

from __future__ import annotations

import re
import urllib.parse
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from sm120fork import gitcmd
from sm120fork.errors import FatalError
from sm120fork.upstream.archive import MemberWriter, is_text, safe_member_path

SUBTREE = "python/sglang"
LICENSE = "LICENSE"
_RELEASE_TAG = re.compile(r"v?(\d+(?:\.\d+)+(?:\.post\d+)?)")


@dataclass(frozen=True)
class GitTree:
    commit: str
    skipped: tuple[str, ...]  # paths of binary files not written
    hashes: tuple[tuple[str, str], ...] = ()  # (path, sha256 hex) of each file written

    @property
    def files(self) -> int:
        """How many files were written."""
        return len(self.hashes)


def public_url(url: str) -> str:
    """`url` without user:password@, fit to be written into the lock."""
    parts = urllib.parse.urlsplit(url)
    if parts.scheme and "@" in parts.netloc:
        return urllib.parse.urlunsplit(parts._replace(netloc=parts.netloc.rpartition("@")[2]))
    return url


def release_tags(url: str, workdir: Path) -> dict[str, str]:
    """version -> tag for every release-looking tag of the remote (`v` tags win)."""
    # The user's config: credentials, URL rewrites and proxies for the remote.
    listed = gitcmd.run(["ls-remote", "--tags", "--refs", url], workdir, user_config=True)
    out = listed.stdout.decode("utf-8", "replace")
    tags: dict[str, str] = {}
    for line in out.splitlines():
        ref = line.partition("\t")[2]
        tag = ref.removeprefix("refs/tags/")
        match = _RELEASE_TAG.fullmatch(tag)
        if match and (match.group(1) not in tags or tag.startswith("v")):
            tags[match.group(1)] = tag
    return tags


def fetch_tree(url: str, tag: str, workdir: Path, dest: Path) -> GitTree:
    """Write `LICENSE` and the text files of `python/sglang` at `tag` under `dest`."""
    git_dir = fetched_repository(workdir)
    git = ["--git-dir", str(git_dir)]
    gitcmd.run(["init", "-q", "--bare", str(git_dir)], workdir)
    ref = f"refs/tags/{tag}"
    fetch = [*git, "fetch", "-q", "--depth=1", "--no-tags", url, f"+{ref}:{ref}"]
    gitcmd.run(fetch, workdir, user_config=True)
    commit = gitcmd.output([*git, "rev-parse", "--verify", f"{ref}^{{commit}}"], workdir)
    listing = gitcmd.run(
        [*git, "ls-tree", "-r", "-z", "--full-tree", commit, "--", LICENSE, SUBTREE], workdir
    ).stdout
    entries = _entries(listing, tag)
    if LICENSE not in entries:
        raise FatalError(f"{tag} of {public_url(url)} has no top-level LICENSE; cannot vendor it")
    if not any(path.startswith(SUBTREE + "/") for path in entries):
        raise FatalError(
            f"{tag} of {public_url(url)} has no {SUBTREE}/; is it sglang's repository?"
        )
    blobs = _read_blobs(git_dir, [oid for oid, _ in entries.values()], workdir)
    skipped: list[str] = []
    with MemberWriter(dest) as writer:
        for path, (oid, mode) in sorted(entries.items()):
            data = blobs[oid]
            if is_text(data):
                writer.write(path, PurePosixPath(path), data, executable=mode == "100755")
            elif path == LICENSE:
                raise FatalError(f"{tag}: LICENSE is not a text file; refusing it")
            else:
                skipped.append(path)
        hashes = writer.hashes()
    return GitTree(commit=commit, skipped=tuple(skipped), hashes=tuple(hashes))


def fetched_repository(workdir: Path) -> Path:
    """The bare repository `fetch_tree(..., workdir, ...)` fetches into (and leaves)."""
    return workdir / "upstream.git"


def _entries(listing: bytes, tag: str) -> dict[str, tuple[str, str]]:
    """path -> (blob id, mode), refusing links, submodules and unsafe paths."""
    entries: dict[str, tuple[str, str]] = {}
    for record in listing.decode("utf-8", "surrogateescape").split("\0"):
        if not record:
            continue
        meta, _, path = record.partition("\t")
        mode, kind, oid = meta.split()
        safe_member_path(path, tag)
        if mode == "120000":
            raise FatalError(f"{tag}: member {path!r} is a symlink; refusing this tag")
        if kind != "blob":
            raise FatalError(f"{tag}: member {path!r} is a {kind} (submodule); refusing this tag")
        entries[path] = (oid, mode)
    return entries


def _read_blobs(git_dir: Path, oids: list[str], workdir: Path) -> dict[str, bytes]:
    blobs: dict[str, bytes] = {}
    with gitcmd.ObjectReader(workdir, git_dir) as objects:
        for oid in sorted(set(oids)):
            data = objects.read(oid)
            if data is None:
                raise FatalError(
                    f"git could not read object {oid} of the fetched tag; fetch it again"
                )
            blobs[oid] = data
    return blobs
