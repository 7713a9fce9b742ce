"""Where upstream releases come from: the package index, or a git remote's tags.

`--upstream-git URL`, or its absence, becomes an `UpstreamSource` where the
command line is read; what follows asks it rather than testing a URL for None.
"""

from __future__ import annotations

from dataclasses import dataclass

from sm120fork.upstream.git import public_url
from sm120fork.upstream.lock import Source


@dataclass(frozen=True)
class UpstreamSource:
    git_url: str | None = None  # None: the package index

    @property
    def kind(self) -> Source:
        """As the lock and the rebase report name it: `pypi` or `git`."""
        return "pypi" if self.git_url is None else "git"

    @property
    def name(self) -> str:
        """As a progress line names it: `fetching sglang 0.5.24 from <name>`."""
        return "the package index" if self.git_url is None else "git"

    @property
    def where(self) -> str:
        """As `resolve_version`'s messages name it: `on the package index`, `at URL`."""
        return "on the package index" if self.git_url is None else f"at {public_url(self.git_url)}"


PACKAGE_INDEX = UpstreamSource()
