"""The package index's files of a release: download the wheel and sdist, and check
each against the index's file list and the lock in force."""

from __future__ import annotations

import shutil
from pathlib import Path

from sm120fork.errors import FatalError
from sm120fork.upstream import index as upstream_index
from sm120fork.upstream import pypi as upstream_pypi
from sm120fork.upstream.index import IndexFile
from sm120fork.upstream.lock import Artifact, Lock
from sm120fork.upstream.pypi import sha256_of
from sm120fork.upstream.release import Progress, quiet

_CHANGED = "the file changed since it was locked: check pip's index or mirror before trusting it"


def download_locked_wheel(
    lock: Lock,
    dest: Path,
    *,
    python_tag: str | None = None,
    platform: str | None = None,
    progress: Progress = quiet,
) -> Path:
    """The wheel of the locked release for this interpreter, or for `python_tag`
    (cp312) / `platform` (manylinux_2_34_x86_64), as `dest/<file>`, checked
    against the lock's sha256."""
    wheels = [a.file for a in lock.artifacts if a.file.endswith(".whl")]
    if not wheels:
        raise FatalError(
            f"the lock records no wheel of sglang {lock.version} (source {lock.source}); "
            f"run `sm120fork import {lock.version}` to lock the package index's files"
        )
    dest.mkdir(parents=True, exist_ok=True)
    progress(f"downloading the sglang {lock.version} wheel")
    target = upstream_pypi.target_options(python_tag, platform)
    try:
        wheel = download_wheel(lock.version, dest, target, [] if target else wheels)
    except upstream_pypi.NoMatchingFile:
        wanted = " ".join(x for x in (python_tag, platform) if x)
        raise FatalError(
            f"sglang {lock.version} has no wheel for {wanted}; the lock lists {', '.join(wheels)}"
        ) from None
    try:
        verify(wheel, None, lock)
        final = dest / wheel.name
        wheel.replace(final)
    finally:
        shutil.rmtree(wheel.parent, ignore_errors=True)
    return final


def download_wheel(version: str, workdir: Path, target: list[str], fallback: list[str]) -> Path:
    try:
        return upstream_pypi.download_wheel(version, workdir, target=target)
    except upstream_pypi.NoMatchingFile:
        # From 0.5.11 on wheels are per CPython version; this interpreter may have none.
        options = upstream_pypi.fallback_wheel(fallback)
        if options is None:
            raise
        return upstream_pypi.download_wheel(version, workdir, target=options)


def index_versions(files: tuple[IndexFile, ...] | None) -> set[str]:
    """What pip offers this interpreter, plus what the index lists for any other."""
    try:
        from_pip: tuple[str, ...] = upstream_pypi.available_versions()
    except FatalError:
        if files is None:
            raise
        from_pip = ()
    return set(from_pip) | upstream_index.listed_versions(files)


def known_files(listing: tuple[IndexFile, ...] | None, pinned: Lock | None) -> list[str]:
    """The release's file names from the index, else from the lock: the wheels to
    fall back on when none fits this interpreter."""
    if listing:
        return [entry.file for entry in listing]
    return [artifact.file for artifact in pinned.artifacts] if pinned else []


def download_sdist(
    version: str, workdir: Path, listing: tuple[IndexFile, ...] | None, progress: Progress
) -> Path | None:
    if listing is None:
        progress(f"downloading the sglang {version} sdist (for its LICENSE)")
        return upstream_pypi.download_sdist(version, workdir)
    sdists = [entry for entry in listing if not entry.file.endswith(".whl")]
    if not sdists:
        progress(f"sglang {version} has no sdist; taking LICENSE from the wheel")
        return None
    progress(f"downloading {sdists[0].file} (for its LICENSE)")
    return upstream_index.fetch_url(sdists[0], workdir)


def check_listing(listing: tuple[IndexFile, ...] | None, pinned: Lock | None) -> None:
    for entry in listing or ():
        locked = pinned.artifact(entry.file) if pinned else None
        if locked and locked.sha256 != entry.sha256:
            raise FatalError(
                f"the index lists {entry.file} with sha256 {entry.sha256} but the lock "
                f"pins {locked.sha256}; {_CHANGED}"
            )


def verify(path: Path, listing: tuple[IndexFile, ...] | None, pinned: Lock | None) -> Artifact:
    """`path` as an artifact, refused when it differs from the index's list or the lock."""
    actual = Artifact(path.name, sha256_of(path), path.stat().st_size)
    listed = next((entry for entry in listing or () if entry.file == path.name), None)
    if listed is not None and listed.sha256 != actual.sha256:
        raise FatalError(
            f"downloaded {path.name} has sha256 {actual.sha256} but the index lists "
            f"{listed.sha256}; the download is damaged or was altered: retry, then check the mirror"
        )
    if pinned is not None:
        locked = pinned.artifact(path.name)
        # A file the index lists (and so vouches for) may be a late upload to the
        # release; a file nobody vouches for is refused.
        if locked is None and listed is None:
            raise FatalError(
                f"downloaded {path.name}, which the lock of sglang {pinned.version} does not "
                "list; pass a python tag/platform the lock lists, or re-run the import where "
                "the index's file list is readable"
            )
        if locked is not None and locked.sha256 != actual.sha256:
            raise FatalError(
                f"downloaded {path.name} has sha256 {actual.sha256} but the lock pins "
                f"{locked.sha256}; {_CHANGED}"
            )
    return actual


def artifacts_of(
    listing: tuple[IndexFile, ...] | None, downloaded: list[Artifact], pinned: Lock | None
) -> tuple[Artifact, ...]:
    """Every file of the release: the index's list when readable, else what the lock
    already knew plus what was downloaded now."""
    found = {a.file: a for a in (pinned.artifacts if pinned and listing is None else ())}
    for entry in listing or ():
        found[entry.file] = Artifact(entry.file, entry.sha256, entry.size)
    for artifact in downloaded:
        found[artifact.file] = artifact  # a measured size beats a missing one
    return tuple(sorted(found.values(), key=lambda a: a.file))
