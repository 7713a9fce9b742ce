"""Fetch an upstream sglang release as a tree laid out like upstream's repository.

The steps a maintainer would do by hand: pick the release (`resolve_version`),
download it from the package index or a git remote, check every file against
the index, the wheel's RECORD and the existing lock, and lay out
`python/sglang/...` + `LICENSE`. The import command, the rebase and the wheel
builder all go through `fetch_release` / `download_locked_wheel`.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from sm120fork import upstream_git, upstream_index, upstream_pypi
from sm120fork.archive import extract_wheel_package, read_sdist_license
from sm120fork.errors import FatalError
from sm120fork.lock import Artifact, Lock, Source
from sm120fork.manifest import Manifest, sha256_hex
from sm120fork.upstream_index import IndexFile
from sm120fork.upstream_pypi import sha256_of
from sm120fork.upstream_versions import SPEC_HELP, resolve_version

__all__ = [
    "SPEC_HELP",
    "Progress",
    "Release",
    "available_versions",
    "download_locked_wheel",
    "fetch_release",
    "resolve_version",
    "where",
]

Progress = Callable[[str], None]
_CHANGED = "the file changed since it was locked: check pip's index or mirror before trusting it"


def _quiet(message: str) -> None:
    pass


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


def available_versions(git_url: str | None = None, *, workdir: Path | None = None) -> list[str]:
    """Every release-looking version the source has, for `resolve_version`: the
    remote's tags, or the package index's versions for any interpreter (pip alone
    hides releases without a wheel for this one, e.g. 0.5.23 on Python 3.10)."""
    if git_url is not None:
        return list(upstream_git.release_tags(git_url, workdir or Path.cwd()))
    return sorted(_index_versions(upstream_index.project_files()))


def where(git_url: str | None) -> str:
    """How `resolve_version` names the source in its messages."""
    return "on the package index" if git_url is None else f"at {upstream_git.public_url(git_url)}"


def fetch_release(
    spec: str,
    *,
    git_url: str | None = None,
    workdir: Path,
    progress: Progress = _quiet,
    locked: Lock | None = None,
) -> Release:
    """Download release `spec`, verify it, and lay it out in `workdir/tree`.

    `locked` is the lock in force: when it pins the same version from the same
    source, what is downloaded now must match it (same sha256, same commit).
    """
    if (workdir / "tree").exists():
        raise FileExistsError(f"{workdir / 'tree'} exists; fetch_release needs a fresh workdir")
    workdir.mkdir(parents=True, exist_ok=True)
    if git_url is not None:
        return _fetch_git(spec, git_url, workdir, progress, locked)
    progress("listing sglang releases on the package index")
    files = upstream_index.project_files()
    version = resolve_version(spec, _index_versions(files))
    pinned = locked if locked and locked.source == "pypi" and locked.version == version else None
    listing = upstream_index.release_files(files, version)
    if listing is None:
        progress("warning: cannot read the index's file list; locking only the downloaded files")
    _check_listing(listing, pinned)

    progress(f"downloading the sglang {version} wheel")
    wheel = _download_wheel(version, workdir, [], _known_files(listing, pinned))
    downloaded = [_verify(wheel, listing, pinned)]
    sdist = _download_sdist(version, workdir, listing, progress)
    if sdist is not None:
        downloaded.append(_verify(sdist, listing, pinned))

    tree = workdir / "tree"
    progress(f"verifying every member of {wheel.name} against its RECORD")
    extracted = extract_wheel_package(wheel, "sglang", tree / "python")
    if sdist is not None:
        member, text = read_sdist_license(sdist)
        license_from = f"{sdist.name}:{member}"
    elif extracted.license is not None:
        member, text = extracted.license
        license_from = f"{wheel.name}:{member}"
    else:
        raise FatalError(
            f"sglang {version} has no sdist and its wheel no LICENSE; import it with --upstream-git"
        )
    (tree / "LICENSE").write_bytes(text)
    hashes = [(f"python/{name}", sha256) for name, sha256 in extracted.hashes]
    hashes.append(("LICENSE", sha256_hex(text)))
    progress(f"extracted {extracted.files} text files, skipped {len(extracted.skipped)} binary")
    return Release(
        version=version,
        tag=f"v{version}",
        source="pypi",
        tree=tree,
        tree_from=wheel.name,
        license_from=license_from,
        artifacts=_artifacts(listing, downloaded, pinned),
        skipped=tuple(f"python/{member}" for member in extracted.skipped),
        wheel=wheel,
        files=tuple(hashes),
    )


def download_locked_wheel(
    lock: Lock,
    dest: Path,
    *,
    python_tag: str | None = None,
    platform: str | None = None,
    progress: Progress = _quiet,
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
        wheel = _download_wheel(lock.version, dest, target, [] if target else wheels)
    except upstream_pypi.NoMatchingFile:
        wanted = " ".join(x for x in (python_tag, platform) if x)
        raise FatalError(
            f"sglang {lock.version} has no wheel for {wanted}; the lock lists {', '.join(wheels)}"
        ) from None
    try:
        _verify(wheel, None, lock)
        final = dest / wheel.name
        wheel.replace(final)
    finally:
        shutil.rmtree(wheel.parent, ignore_errors=True)
    return final


def _fetch_git(
    spec: str, url: str, workdir: Path, progress: Progress, locked: Lock | None
) -> Release:
    public = upstream_git.public_url(url)
    progress(f"listing release tags of {public}")
    tags = upstream_git.release_tags(url, workdir)
    version = resolve_version(spec, tags, where=f"at {public}")
    tag = tags[version]
    progress(f"fetching {tag} from {public}")
    tree = upstream_git.fetch_tree(url, tag, workdir, workdir / "tree")
    pinned = locked if locked and locked.source == "git" and locked.version == version else None
    if pinned is not None and pinned.commit != tree.commit:
        raise FatalError(
            f"{tag} of {public} is now commit {tree.commit} but the lock pins {pinned.commit}; "
            "the tag moved upstream: find out why, then delete vendor/sglang.lock to re-pin"
        )
    progress(f"extracted {tree.files} text files, skipped {len(tree.skipped)} binary")
    return Release(
        version=version,
        tag=tag,
        source="git",
        tree=workdir / "tree",
        tree_from=tree.commit,
        license_from=f"{tree.commit}:{upstream_git.LICENSE}",
        skipped=tree.skipped,
        url=public,
        commit=tree.commit,
        files=tree.hashes,
    )


def _download_wheel(version: str, workdir: Path, target: list[str], fallback: list[str]) -> Path:
    try:
        return upstream_pypi.download_wheel(version, workdir, target=target)
    except upstream_pypi.NoMatchingFile:
        # From 0.5.11 on wheels are per CPython version; this interpreter may have none.
        options = upstream_pypi.fallback_wheel(fallback)
        if options is None:
            raise
        return upstream_pypi.download_wheel(version, workdir, target=options)


def _index_versions(files: tuple[IndexFile, ...] | None) -> set[str]:
    """What pip offers this interpreter, plus what the index lists for any other."""
    try:
        from_pip: tuple[str, ...] = upstream_pypi.available_versions()
    except FatalError:
        if files is None:
            raise
        from_pip = ()
    return set(from_pip) | upstream_index.listed_versions(files)


def _known_files(listing: tuple[IndexFile, ...] | None, pinned: Lock | None) -> list[str]:
    """The release's file names from the index, else from the lock: the wheels to
    fall back on when none fits this interpreter."""
    if listing:
        return [entry.file for entry in listing]
    return [artifact.file for artifact in pinned.artifacts] if pinned else []


def _download_sdist(
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


def _check_listing(listing: tuple[IndexFile, ...] | None, pinned: Lock | None) -> None:
    for entry in listing or ():
        locked = pinned.artifact(entry.file) if pinned else None
        if locked and locked.sha256 != entry.sha256:
            raise FatalError(
                f"the index lists {entry.file} with sha256 {entry.sha256} but the lock "
                f"pins {locked.sha256}; {_CHANGED}"
            )


def _verify(path: Path, listing: tuple[IndexFile, ...] | None, pinned: Lock | None) -> Artifact:
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


def _artifacts(
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
