"""Upstream sglang: pick a release, fetch and verify it, and record where it came from.

`fetch` lays out a release (from the package index via `artifacts`, `index` and
`pypi`, or from a git remote via `git`: the `source`); `archive` reads wheels and sdists;
`versions` resolves a version spec; `lock` and `manifest` are vendor/sglang.lock
and vendor/sglang.sha256; `pristine` checks the vendored tree against both. Import
each name from its module; the package names only where a release comes from.
"""

from __future__ import annotations

from sm120fork.upstream.source import PACKAGE_INDEX, UpstreamSource

__all__ = ["PACKAGE_INDEX", "UpstreamSource"]
