"""`vendor/sglang.sha256`: the sha256 of every file of vendor/sglang as upstream shipped it.

Written beside the lock by `import` and `rebase`, from the members they
verified on the way in (the wheel's RECORD, or git's blobs), so that the tree
can be checked without the network: `check` lists every file that differs,
and the wheel build, `apply` and the rebase refuse such a tree. One line per
file in GNU sha256sum's format, sorted by path, under a comment naming the
release, so it can also be checked by hand:

    # sglang 0.5.23: sha256 of every file of vendor/sglang, written by `sm120fork import`; ...
    <64 hex digits>  LICENSE
    <64 hex digits>  python/sglang/__init__.py
"""

from __future__ import annotations

import hashlib
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from sm120fork.errors import FatalError
from sm120fork.paths import MANIFEST_NAME

_HEADER = re.compile(r"# sglang (?P<version>\S+): ")
_LINE = re.compile(r"(?P<sha256>[0-9a-f]{64}) [ *](?P<path>[^\n\r\\]+)")
# Python's bytecode cache, which git ignores: written into the pristine tree by
# anything that imports it, never part of upstream's release.
_IGNORED_DIRS = frozenset({"__pycache__"})

Kind = Literal["changed", "added", "deleted", "not a file"]


@dataclass(frozen=True)
class Manifest:
    version: str
    files: tuple[tuple[str, str], ...]  # (path in the tree, sha256 hex), sorted by path

    @classmethod
    def create(cls, version: str, hashes: Mapping[str, str]) -> Manifest:
        for path in hashes:
            odd = any(char in path for char in "\n\r\\") or ".." in path.split("/")
            if not path or odd or path.startswith("/"):
                raise FatalError(
                    f"upstream file {path!r} cannot be named in {MANIFEST_NAME}; refusing the tree"
                )
        return cls(version, tuple(sorted(hashes.items())))

    def hashes(self) -> dict[str, str]:
        return dict(self.files)


@dataclass(frozen=True, order=True)
class Difference:
    path: str  # relative to the tree, posix
    kind: Kind


def sha256_hex(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def dumps(manifest: Manifest) -> str:
    lines = [
        f"# sglang {manifest.version}: sha256 of every file of vendor/sglang, written by "
        "`sm120fork import` or `rebase`; never edited by hand.",
        "# Check by hand: (cd vendor/sglang && sha256sum --check --quiet ../sglang.sha256)",
    ]
    lines += [f"{sha256}  {path}" for path, sha256 in manifest.files]
    return "\n".join(lines) + "\n"


def loads(text: str, origin: str) -> Manifest:
    fix = "re-vendor the release with `sm120fork import VERSION`"
    lines = text.split("\n")
    if lines[-1] == "":
        lines.pop()  # the text ends with a newline
    header = _HEADER.match(lines[0]) if lines else None
    if header is None:
        raise FatalError(f"{origin}:1: no `# sglang VERSION: ...` header; {fix}")
    files: dict[str, str] = {}
    for lineno, line in enumerate(lines, start=1):
        if line.startswith("#"):
            continue
        match = _LINE.fullmatch(line)
        if match is None:
            shape = "64 hex digits, two spaces, a path"
            raise FatalError(f"{origin}:{lineno}: not a sha256sum line ({shape}); {fix}")
        if match["path"] in files:
            raise FatalError(f"{origin}:{lineno}: {match['path']} is listed twice; {fix}")
        files[match["path"]] = match["sha256"]
    if not files:
        raise FatalError(f"{origin} lists no file; {fix}")
    return Manifest.create(header["version"], files)


def read(path: Path) -> Manifest | None:
    """The manifest at `path`, or None when there is none."""
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return None
    except (OSError, UnicodeDecodeError) as error:
        raise FatalError(
            f"cannot read {path}: {error}; re-vendor with `sm120fork import`"
        ) from error
    return loads(text, origin=str(path))


def hash_tree(tree: Path) -> dict[str, str | None]:
    """path -> sha256 of every file under `tree`; None for what is not a regular
    file or directory (a symlink, a fifo). Bytecode caches are left out."""
    found: dict[str, str | None] = {}
    pending = [(str(tree), "")]
    while pending:
        directory, prefix = pending.pop()
        with os.scandir(directory) as entries:  # file types from the directory: no stat each
            for entry in entries:
                name = prefix + entry.name
                if entry.is_symlink():
                    found[name] = None
                elif entry.is_dir():
                    if entry.name not in _IGNORED_DIRS:
                        pending.append((entry.path, name + "/"))
                elif entry.is_file():
                    with open(entry.path, "rb") as handle:
                        found[name] = sha256_hex(handle.read())
                else:
                    found[name] = None
    return found


def verify(tree: Path, manifest: Manifest) -> list[Difference]:
    """Every file of `tree` that is not as `manifest` records it, sorted by path."""
    expected = manifest.hashes()
    actual = hash_tree(tree)
    differences = []
    for path in sorted(set(expected) | set(actual)):
        if path not in actual:
            differences.append(Difference(path, "deleted"))
        elif actual[path] is None:
            differences.append(Difference(path, "not a file"))
        elif path not in expected:
            differences.append(Difference(path, "added"))
        elif actual[path] != expected[path]:
            differences.append(Difference(path, "changed"))
    return differences
