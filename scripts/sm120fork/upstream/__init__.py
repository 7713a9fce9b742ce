"""Upstream sglang: pick a release, fetch and verify it, and record where it came from.

`fetch` lays out a release (from the package index via `artifacts`, `index` and
`pypi`, or from a git remote via `git`: the `source`); `archive` reads wheels and sdists;
`versions` resolves a version spec; `lock` and `manifest` are vendor/sglang.lock
and vendor/sglang.sha256; `pristine` checks the vendored tree against both.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from sm120fork.upstream.artifacts import download_locked_wheel
    from sm120fork.upstream.fetch import available_versions, fetch_release
    from sm120fork.upstream.release import Progress, Release
    from sm120fork.upstream.source import PACKAGE_INDEX, UpstreamSource
    from sm120fork.upstream.versions import SPEC_HELP, resolve_version

# Loaded when first asked for: every command imports `upstream.manifest` (through
# `paths`), and fetching pulls in http.client, urllib and GitPython (~0.2 s a start).
_FROM = {
    "download_locked_wheel": "artifacts",
    "available_versions": "fetch",
    "fetch_release": "fetch",
    "Progress": "release",
    "Release": "release",
    "PACKAGE_INDEX": "source",
    "UpstreamSource": "source",
    "SPEC_HELP": "versions",
    "resolve_version": "versions",
}


def __getattr__(name: str) -> Any:
    if name not in _FROM:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_FROM[name]}"), name)


__all__ = [
    "PACKAGE_INDEX",
    "SPEC_HELP",
    "Progress",
    "Release",
    "UpstreamSource",
    "available_versions",
    "download_locked_wheel",
    "fetch_release",
    "resolve_version",
]
