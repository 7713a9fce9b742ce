"""What `fetch_release` hands back: the laid-out tree of one upstream release and
where every file of it came from, as the lock and manifest record it."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from sm120fork.upstream.lock import Artifact, Lock, Source
from sm120fork.upstream.manifest import Manifest

Progress = Callable[[str], None]


def quiet(message: str) -> None:
    """The default progress: say nothing."""


@dataclass(frozen=True)
class Release:
    version: str
    tag: str
    source: Source
    tree: Path  # holds python/sglang/... and LICENSE
    tree_from: str  # the wheel's file name, or the commit
    license_from: str  # "<artifact or commit>:<member>"
    artifacts: tuple[Artifact, ...] = ()
    skipped: tuple[str, ...] = ()  # binary files left out, as python/sglang/... paths
    wheel: Path | None = None  # the wheel the tree came from (pypi only)
    url: str | None = None  # git only, without credentials
    commit: str | None = None  # git only
    files: tuple[tuple[str, str], ...] = ()  # (path in the tree, sha256) of every file in it

    def manifest(self) -> Manifest:
        """vendor/sglang.sha256 for this tree: the hashes of the members as verified."""
        return Manifest.create(self.version, dict(self.files))

    def lock(self, imported: str) -> Lock:
        return Lock(
            version=self.version,
            tag=self.tag,
            source=self.source,
            imported=imported,
            tree_from=self.tree_from,
            license_from=self.license_from,
            url=self.url,
            commit=self.commit,
            skipped=self.skipped,
            artifacts=self.artifacts,
        )
