"""The package index's own list of a release's files, read where pip reads.

The lock records every file of a release (all platform wheels and the sdist),
not only the one pip picked. That list comes from the simple page (PEP 691
JSON or PEP 503 HTML) of the indexes pip is configured with, found at run
time, so that no index host is written anywhere in the project.
"""

from __future__ import annotations

import ast
import importlib
import json
import shutil
import tempfile
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass
from html.parser import HTMLParser
from pathlib import Path

from packaging.utils import (
    InvalidSdistFilename,
    InvalidWheelFilename,
    parse_sdist_filename,
    parse_wheel_filename,
)
from packaging.version import InvalidVersion, Version

from sm120fork.errors import FatalError
from sm120fork.upstream.pypi import PROJECT, pip

_ACCEPT = ", ".join(
    [
        "application/vnd.pypi.simple.v1+json",
        "application/vnd.pypi.simple.v1+html;q=0.2",
        "text/html;q=0.1",
    ]
)


@dataclass(frozen=True)
class IndexFile:
    """One file of a release as the index lists it."""

    file: str
    sha256: str
    size: int | None
    url: str
    yanked: bool = False


def file_version(name: str) -> Version | None:
    """The version in a wheel or sdist file name of sglang, None for anything else."""
    try:
        if name.endswith(".whl"):
            project, version, _, _ = parse_wheel_filename(name)
        else:
            project, version = parse_sdist_filename(name)
    except (InvalidWheelFilename, InvalidSdistFilename, InvalidVersion):
        return None
    return version if project == PROJECT else None


def project_files() -> tuple[IndexFile, ...] | None:
    """Every file of sglang on pip's indexes, whatever interpreter it is for; None
    when no index could be read (the caller then locks what it downloaded)."""
    found: dict[str, IndexFile] = {}
    readable = False
    for index in index_urls():
        try:
            files = _project_files(index)
        except (OSError, ValueError, KeyError, TypeError, urllib.error.URLError):
            continue  # an unreachable or foreign extra index is pip's business, not ours
        readable = True
        for entry in files:
            if file_version(entry.file) is None:
                continue
            known = found.setdefault(entry.file, entry)
            if known.sha256 != entry.sha256:
                raise FatalError(
                    f"two indexes disagree on the sha256 of {entry.file}; "
                    "fix pip's index configuration before importing"
                )
    return tuple(sorted(found.values(), key=lambda f: f.file)) if readable else None


def listed_versions(files: tuple[IndexFile, ...] | None) -> set[str]:
    """The versions that have a file that is not yanked.

    `pip index versions` shows only versions with a file for this interpreter
    (0.5.23 has no cp310 wheel), so the index's own list completes it."""
    return {str(file_version(f.file)) for f in files or () if not f.yanked}


def release_files(
    files: tuple[IndexFile, ...] | None, version: str
) -> tuple[IndexFile, ...] | None:
    """The files of `version`; None when the index's list is unknown or lacks it."""
    wanted = Version(version)
    return tuple(f for f in files or () if file_version(f.file) == wanted) or None


def index_urls() -> tuple[str, ...]:
    """pip's index URL then its extra index URLs, as `pip config list` reports them."""
    settings: dict[str, str] = {}
    for line in pip(["config", "list"]).stdout.splitlines():
        key, _, raw = line.partition("=")
        try:
            settings[key.strip()] = str(ast.literal_eval(raw.strip()))
        except (ValueError, SyntaxError):
            continue
    scopes = (":env:", "download", "global")  # pip's precedence, strongest first

    def lookup(name: str) -> str | None:
        return next((settings[f"{s}.{name}"] for s in scopes if f"{s}.{name}" in settings), None)

    main = lookup("index-url") or _pip_default_index()
    return (*([main] if main else []), *(lookup("extra-index-url") or "").split())


def _pip_default_index() -> str | None:
    # pip's own default, read from pip so that no host name lives in this project.
    try:
        return str(importlib.import_module("pip._internal.models.index").PyPI.simple_url)
    except (ImportError, AttributeError):  # pip's internals moved: list no default index
        return None


def _project_files(index: str) -> list[IndexFile]:
    url = index.rstrip("/") + f"/{PROJECT}/"
    body, content_type, base = _fetch(url)
    if "json" in content_type:
        files = json.loads(body)["files"]
        return [
            IndexFile(
                f["filename"],
                f["hashes"]["sha256"],
                f.get("size"),
                urllib.parse.urljoin(base, f["url"]),
                bool(f.get("yanked")),
            )
            for f in files
            if "sha256" in f.get("hashes", {})
        ]
    parser = _Anchors()
    parser.feed(body.decode("utf-8", "replace"))
    listed = []
    for href, text, yanked in parser.anchors:
        link, _, fragment = urllib.parse.urljoin(base, href).partition("#")
        algorithm, _, digest = fragment.partition("=")
        name = text.strip() or urllib.parse.unquote(link.rsplit("/", 1)[-1])
        if algorithm == "sha256" and digest:
            listed.append(IndexFile(name, digest.lower(), None, link, yanked))
    return listed


def _fetch(url: str) -> tuple[bytes, str, str]:
    parts = urllib.parse.urlsplit(url)
    if parts.scheme == "file":  # a local simple repository: directories hold index.html
        path = Path(urllib.request.url2pathname(parts.path))
        return (path / "index.html").read_bytes(), "text/html", url
    request = urllib.request.Request(url, headers={"Accept": _ACCEPT})
    with urllib.request.urlopen(request, timeout=60) as response:
        return response.read(), response.headers.get("Content-Type", ""), response.geturl()


class _Anchors(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.anchors: list[tuple[str, str, bool]] = []  # href, text, yanked
        self._href: str | None = None
        self._yanked = False
        self._text: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if tag == "a":
            attributes = dict(attrs)
            self._href, self._text = attributes.get("href"), []
            self._yanked = "data-yanked" in attributes

    def handle_data(self, data: str) -> None:
        if self._href is not None:
            self._text.append(data)

    def handle_endtag(self, tag: str) -> None:
        if tag == "a" and self._href is not None:
            self.anchors.append((self._href, "".join(self._text), self._yanked))
            self._href = None


def fetch_url(entry: IndexFile, workdir: Path) -> Path:
    """Download a listed file from its index URL (the caller checks its sha256).

    Used for the sdist: `pip download` of an sdist runs upstream's build backend
    to prepare metadata, which is slow and runs upstream code just to get a file.
    """
    target = Path(tempfile.mkdtemp(dir=workdir)) / entry.file
    try:
        if urllib.parse.urlsplit(entry.url).scheme == "file":
            shutil.copyfile(
                urllib.request.url2pathname(urllib.parse.urlsplit(entry.url).path), target
            )
        else:
            with (
                urllib.request.urlopen(entry.url, timeout=300) as response,
                open(target, "wb") as out,
            ):
                shutil.copyfileobj(response, out)
    except (OSError, urllib.error.URLError) as error:
        raise FatalError(
            f"cannot download {entry.file} ({error}); check the network and retry"
        ) from error
    return target
