"""Which releases to carry the series to, and fetching them (through `upstream`)."""

from __future__ import annotations

import shutil
from pathlib import Path

from packaging.version import Version

from sm120fork.errors import FatalError
from sm120fork.paths import MANIFEST_NAME
from sm120fork.rebase import decisionenv
from sm120fork.upstream import lock, manifest
from sm120fork.upstream.fetch import available_versions, fetch_release
from sm120fork.upstream.release import Progress
from sm120fork.upstream.source import UpstreamSource
from sm120fork.upstream.versions import releases, resolve_version


def plan(spec: str, pinned: str, *, source: UpstreamSource, step: bool, scratch: Path) -> list[str]:
    """The releases to carry to, oldest first: the target, or with `step` every
    release after `pinned` up to it; none when the target is the pinned release
    (up to date: `latest` on a day without a new release). Unknown or older
    targets are refused."""
    available = available_versions(source, workdir=scratch)
    target = resolve_version(spec, available, source.where)
    if Version(target) == Version(pinned):
        return []
    if Version(target) < Version(pinned):
        raise FatalError(f"sglang {target} is older than the pinned {pinned}; name a later release")
    if not step:
        return [target]
    return [text for v, text in releases(available) if Version(pinned) < v <= Version(target)]


def tree(workdir: Path) -> Path:
    """Where `fetch` lays out a release (upstream.fetch.fetch_release's convention)."""
    return workdir / "tree"


def manifest_file(workdir: Path) -> Path:
    """Where `fetch` writes the release's vendor/sglang.sha256."""
    return workdir / MANIFEST_NAME


def fetch(
    version: str,
    *,
    source: UpstreamSource,
    workdir: Path,
    locked: lock.Lock | None,
    progress: Progress,
) -> str:
    """Download `version` into `workdir` (replacing it), write its manifest beside the
    tree, and return its lock's text (saved in the state only once both are there)."""
    if workdir.exists():
        shutil.rmtree(workdir)
    release = fetch_release(
        version, source=source, workdir=workdir, progress=progress, locked=locked
    )
    if release.tree != tree(workdir):  # pragma: no cover - a changed convention is a bug
        raise AssertionError(f"fetch_release wrote {release.tree}, expected {tree(workdir)}")
    manifest_file(workdir).write_text(manifest.dumps(release.manifest()), encoding="utf-8")
    decisionenv.record_pins(workdir, release.wheel, release.commit)
    return lock.dumps(release.lock(lock.today()))
