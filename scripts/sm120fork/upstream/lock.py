"""`vendor/sglang.lock`: where the vendored upstream came from.

TOML, written by hand in a fixed key order so that re-importing the same
release gives the same bytes (only `imported` moves), and read with tomllib.
The index URL is deliberately not recorded: it is pip's configuration on the
machine that ran the import, not a property of the release.

    version = "0.5.9"
    tag = "v0.5.9"
    source = "pypi"                      # or "git", with `url` and `commit`
    imported = "2025-11-29"
    tree_from = "sglang-0.5.9-py3-none-any.whl"    # artifact file, or the commit
    license_from = "sglang-0.5.9.tar.gz:sglang-0.5.9/LICENSE"
    skipped = []                         # binary members left out of the tree

    [[artifacts]]                        # every file of the release on the index
    file = "sglang-0.5.9-py3-none-any.whl"
    sha256 = "..."
    size = 5201033
"""

from __future__ import annotations

import datetime
import os
import re
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, cast

from sm120fork.errors import FatalError

Source = Literal["pypi", "git"]
DATE_ENV = "SM120FORK_DATE"
_DATE = re.compile(r"\d{4}-\d{2}-\d{2}")
_SHA256 = re.compile(r"[0-9a-f]{64}")
_HEADER = "# Provenance of vendor/sglang: written by `sm120fork import`, never edited by hand.\n"


@dataclass(frozen=True)
class Artifact:
    file: str
    sha256: str
    size: int | None = None  # None when the index listed no size and we did not download it


@dataclass(frozen=True)
class Lock:
    version: str
    tag: str
    source: Source
    imported: str  # YYYY-MM-DD
    tree_from: str  # the artifact's file name (pypi) or the commit (git)
    license_from: str  # "<artifact or commit>:<member>"
    url: str | None = None  # git only
    commit: str | None = None  # git only
    skipped: tuple[str, ...] = ()
    artifacts: tuple[Artifact, ...] = ()

    def artifact(self, file: str) -> Artifact | None:
        return next((a for a in self.artifacts if a.file == file), None)


def today() -> str:
    """The import date: $SM120FORK_DATE when set (reproducible runs), else today in UTC."""
    value = os.environ.get(DATE_ENV)
    if value is None:
        return datetime.datetime.now(datetime.UTC).date().isoformat()
    try:
        datetime.date.fromisoformat(value)
    except ValueError:
        value = ""
    if not _DATE.fullmatch(value):
        raise FatalError(f"${DATE_ENV} must be a date as YYYY-MM-DD; unset it or fix it")
    return value


def dumps(lock: Lock) -> str:
    lines = [_HEADER.rstrip("\n")]
    lines.append(f"version = {_string(lock.version)}")
    lines.append(f"tag = {_string(lock.tag)}")
    lines.append(f"source = {_string(lock.source)}")
    if lock.url is not None:
        lines.append(f"url = {_string(lock.url)}")
    if lock.commit is not None:
        lines.append(f"commit = {_string(lock.commit)}")
    lines.append(f"imported = {_string(lock.imported)}")
    lines.append(f"tree_from = {_string(lock.tree_from)}")
    lines.append(f"license_from = {_string(lock.license_from)}")
    if lock.skipped:
        lines.append("skipped = [")
        lines.extend(f"    {_string(path)}," for path in sorted(lock.skipped))
        lines.append("]")
    else:
        lines.append("skipped = []")
    for artifact in sorted(lock.artifacts, key=lambda a: a.file):
        lines.append("")
        lines.append("[[artifacts]]")
        lines.append(f"file = {_string(artifact.file)}")
        lines.append(f"sha256 = {_string(artifact.sha256)}")
        if artifact.size is not None:
            lines.append(f"size = {artifact.size}")
    return "\n".join(lines) + "\n"


def loads(text: str, origin: str = "vendor/sglang.lock") -> Lock:
    fix = f"fix {origin} or re-run `sm120fork import VERSION`"
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as error:
        raise FatalError(f"{origin} is not valid TOML ({error}); {fix}") from error

    def string(key: str, *, required: bool = True) -> str | None:
        value = data.get(key)
        if value is None and not required:
            return None
        if not isinstance(value, str) or not value:
            raise FatalError(f"{origin}: `{key}` must be a non-empty string; {fix}")
        return value

    version, tag, source = string("version"), string("tag"), string("source")
    if source not in ("pypi", "git"):
        raise FatalError(f'{origin}: `source` must be "pypi" or "git"; {fix}')
    imported = cast(str, string("imported"))
    if not _DATE.fullmatch(imported):
        raise FatalError(f"{origin}: `imported` must be a date as YYYY-MM-DD; {fix}")
    skipped = data.get("skipped", [])
    if not isinstance(skipped, list) or not all(isinstance(s, str) for s in skipped):
        raise FatalError(f"{origin}: `skipped` must be a list of paths; {fix}")
    artifacts = tuple(_artifact(item, origin, fix) for item in data.get("artifacts", []))
    return Lock(
        version=cast(str, version),
        tag=cast(str, tag),
        source=cast(Source, source),
        imported=imported,
        tree_from=cast(str, string("tree_from")),
        license_from=cast(str, string("license_from")),
        url=string("url", required=source == "git"),
        commit=string("commit", required=source == "git"),
        skipped=tuple(skipped),
        artifacts=artifacts,
    )


def read(path: Path) -> Lock | None:
    """The lock at `path`, or None when there is none yet."""
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return None
    except (OSError, UnicodeDecodeError) as error:
        raise FatalError(f"cannot read {path}: {error}; fix or delete it") from error
    return loads(text, origin=str(path))


def _artifact(item: object, origin: str, fix: str) -> Artifact:
    if not isinstance(item, dict):
        raise FatalError(f"{origin}: every [[artifacts]] entry must be a table; {fix}")
    file, sha256, size = item.get("file"), item.get("sha256"), item.get("size")
    if not isinstance(file, str) or not file:
        raise FatalError(f"{origin}: an [[artifacts]] entry has no `file`; {fix}")
    if not isinstance(sha256, str) or not _SHA256.fullmatch(sha256):
        raise FatalError(f"{origin}: artifact {file} needs a lowercase hex `sha256`; {fix}")
    if size is not None and (not isinstance(size, int) or isinstance(size, bool) or size < 0):
        raise FatalError(f"{origin}: artifact {file} has a bad `size`; {fix}")
    return Artifact(file=file, sha256=sha256, size=size)


def _string(value: str) -> str:
    """A TOML basic string (escapes exactly what TOML requires)."""
    out = ['"']
    for char in value:
        code = ord(char)
        if char in '"\\':
            out.append("\\" + char)
        elif char == "\t":
            out.append(char)
        elif code < 0x20 or code == 0x7F:
            out.append(f"\\u{code:04x}")
        else:
            out.append(char)
    out.append('"')
    return "".join(out)
