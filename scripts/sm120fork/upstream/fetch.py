"""Fetch an upstream sglang release as a tree laid out like upstream's repository.

The steps a maintainer would do by hand: pick the release (`resolve_version`),
download it from the package index or a git remote, check every file against
the index, the wheel's RECORD and the existing lock, and lay out
`python/sglang/...` + `LICENSE`. The import command, the rebase and the wheel
builder all go through `fetch_release` / `download_locked_wheel`.
"""

from __future__ import annotations

from pathlib import Path

from sm120fork.errors import FatalError
from sm120fork.upstream import artifacts
from sm120fork.upstream import git as upstream_git
from sm120fork.upstream import index as upstream_index
from sm120fork.upstream.archive import extract_wheel_package, read_sdist_license
from sm120fork.upstream.lock import Lock
from sm120fork.upstream.manifest import sha256_hex
from sm120fork.upstream.release import Progress, Release, quiet
from sm120fork.upstream.source import PACKAGE_INDEX, UpstreamSource
from sm120fork.upstream.versions import resolve_version


def available_versions(
    source: UpstreamSource = PACKAGE_INDEX, *, workdir: Path | None = None
) -> list[str]:
    """Every release-looking version the source has, for `resolve_version`: the
    remote's tags, or the package index's versions for any interpreter (pip alone
    hides releases without a wheel for this one, e.g. 0.5.23 on Python 3.10)."""
    if source.git_url is not None:
        return list(upstream_git.release_tags(source.git_url, workdir or Path.cwd()))
    return sorted(artifacts.index_versions(upstream_index.project_files()))


def fetch_release(
    spec: str,
    *,
    source: UpstreamSource = PACKAGE_INDEX,
    workdir: Path,
    progress: Progress = quiet,
    locked: Lock | None = None,
) -> Release:
    """Download release `spec`, verify it, and lay it out in `workdir/tree`.

    `locked` is the lock in force: when it pins the same version from the same
    source, what is downloaded now must match it (same sha256, same commit).
    """
    if (workdir / "tree").exists():
        raise FileExistsError(f"{workdir / 'tree'} exists; fetch_release needs a fresh workdir")
    workdir.mkdir(parents=True, exist_ok=True)
    if source.git_url is not None:
        return _fetch_git(spec, source.git_url, workdir, progress, locked)
    progress("listing sglang releases on the package index")
    files = upstream_index.project_files()
    version = resolve_version(spec, artifacts.index_versions(files))
    pinned = locked if locked and locked.source == "pypi" and locked.version == version else None
    listing = upstream_index.release_files(files, version)
    if listing is None:
        progress("warning: cannot read the index's file list; locking only the downloaded files")
    artifacts.check_listing(listing, pinned)

    progress(f"downloading the sglang {version} wheel")
    wheel = artifacts.download_wheel(version, workdir, [], artifacts.known_files(listing, pinned))
    downloaded = [artifacts.verify(wheel, listing, pinned)]
    sdist = artifacts.download_sdist(version, workdir, listing, progress)
    if sdist is not None:
        downloaded.append(artifacts.verify(sdist, listing, pinned))

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
        artifacts=artifacts.artifacts_of(listing, downloaded, pinned),
        skipped=tuple(f"python/{member}" for member in extracted.skipped),
        wheel=wheel,
        files=tuple(hashes),
    )


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
