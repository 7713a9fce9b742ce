"""`sm120fork wheel`: the flow, step by step as a maintainer would do it by hand.

Read the lock and the fork version, load the series, pick the upstream wheels,
fetch each (checked against the lock), rewrite it, and move the results into
dist/ only when every wheel is built, so that a failure leaves dist/ as it was.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator, Sized
from contextlib import contextmanager
from pathlib import Path

from packaging.version import Version

from sm120fork.errors import FatalError
from sm120fork.forkversion import read_fork_version
from sm120fork.fsutil import create_temporary
from sm120fork.patches.stack import load_stack
from sm120fork.paths import RepoPaths
from sm120fork.upstream import lock as lockfile
from sm120fork.upstream import pristine
from sm120fork.wheel.fetch import fetch
from sm120fork.wheel.metadata import AppliedPatch, ForkInfo
from sm120fork.wheel.select import choose, fork_wheel_name
from sm120fork.wheel.transform import fork_wheel
from sm120fork.wheel.zipfiles import date_time_of

Progress = Callable[[str], None]
EPOCH_ENV = "SOURCE_DATE_EPOCH"


def build_wheels(
    paths: RepoPaths,
    *,
    dist: Path,
    cache: Path,
    every: bool = False,
    artifact: str | None = None,
    progress: Progress,
) -> list[Path]:
    """Build the fork wheel(s) into `dist`; return their paths."""
    lock = lockfile.read(paths.lock_file)
    if lock is None:
        raise FatalError(f"{paths.lock_file} does not exist; run `sm120fork import VERSION` first")
    # The series was checked against vendor/sglang: it must be the release the lock pins.
    pristine.require(paths, "the wheel would carry a series checked against another tree")
    release = read_fork_version(paths.changelog, lock.version)
    version = str(Version(str(release)))
    stack = load_stack(paths)
    targets = choose(lock, every=every, artifact=artifact)
    date_time = date_time_of(_source_date_epoch(release.epoch))
    progress(f"sglang {version}: {_count(stack.patches, 'patch')} on {_count(targets, 'wheel')}")
    applied = tuple(AppliedPatch.create(patch) for patch in stack.patches)
    staged: list[tuple[Path, Path]] = []
    try:
        for target in targets:
            blob = fetch(lock, target, cache, progress)
            info = ForkInfo(version, lock.version, target.file, target.sha256, applied)
            final = dist / fork_wheel_name(target.file, version)
            progress(f"building {final.name}")
            staged.append((_temporary(dist.parent, final.name), final))
            with _writing(final), open(staged[-1][0], "wb") as out:
                done = fork_wheel(
                    blob,
                    target.file,
                    out,
                    vendor=paths.upstream_tree,
                    patches=stack.patches,
                    info=info,
                    date_time=date_time,
                    known_bad=_known_bad(paths),
                )
                out.flush()
                os.fsync(out.fileno())
            progress(f"{final.name}: {done.members} members, {len(done.changed)} from the series")
        with _writing(dist):  # only now, when every wheel is built, does dist/ change
            dist.mkdir(parents=True, exist_ok=True)
            for temporary, final in staged:
                temporary.replace(final)
    finally:
        for temporary, _ in staged:
            temporary.unlink(missing_ok=True)
    return [final for _, final in staged]


@contextmanager
def _writing(target: Path) -> Iterator[None]:
    try:
        yield
    except OSError as error:
        raise FatalError(f"cannot write {target}: {error.strerror or error}") from error


def _temporary(directory: Path, name: str) -> Path:
    # Normal file permissions (fsutil): a dist/ wheel must be installable by another user.
    with _writing(directory):
        fd, path = create_temporary(directory, name, suffix=".tmp")
        os.close(fd)
    return path


def _known_bad(paths: RepoPaths) -> bytes | None:
    table = paths.patches_dir / "known-bad.toml"
    try:
        return table.read_bytes()
    except FileNotFoundError:
        return None
    except OSError as error:
        raise FatalError(f"cannot read {table}: {error.strerror}") from error


def _source_date_epoch(default: int) -> int:
    """$SOURCE_DATE_EPOCH when set, else `default` (the CHANGELOG entry's date)."""
    value = os.environ.get(EPOCH_ENV, "").strip()
    if not value:
        return default
    if not value.isdigit():
        raise FatalError(f"${EPOCH_ENV} must be whole seconds since 1970; unset it or fix it")
    return int(value)


def _count(items: Sized, noun: str) -> str:
    return f"{len(items)} {noun}" + ("" if len(items) == 1 else "es" if noun.endswith("h") else "s")
